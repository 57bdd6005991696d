"""AnnotateEmbedding: the token embedding lookup."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_const, wildcard

from ._fusion import RegionPattern, call, fuse_regions, is_float, static_shape


def embedding_patterns() -> list[RegionPattern]:
    """``take(table, ids, axis=0)`` on a constant 2-D float table.

    ONNX Gather allows negative indices, so the importer wraps the ids in
    ``where(ids < 0, ids + n, ids)``; that normalisation belongs to the lookup.
    """
    ids, table = wildcard(), is_const()
    wrapped = call("relax.where", 
        call("relax.less", ids, is_const()), call("relax.add", ids, wildcard()), ids
    )
    normalised = call("relax.take", table, wrapped)
    plain = call("relax.take", table, ids)

    def check(m, ctx):
        take = ctx.matched_expr
        return (
            len(static_shape(m["table"])) == 2
            and is_float(m["table"])
            and int(take.attrs.axis) == 0
        )

    def attrs(m):
        vocab, hidden = static_shape(m["table"])
        return {"vocab_size": vocab, "hidden_size": hidden}

    return [
        RegionPattern("embedding", normalised, {"table": table, "ids": ids}, check, attrs),
        RegionPattern("embedding", plain, {"table": table, "ids": ids}, check, attrs),
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateEmbedding")
class AnnotateEmbedding:
    """Group the token embedding lookup into an ``edgetvm.embedding`` composite.

    The lookup is a gather from a (vocab, hidden) weight table that lives in DRAM; the NPU
    turns it into one DMA per token, so it must be told apart from a generic ``take``
    (which may gather from shape tensors). Attributes: ``vocab_size``, ``hidden_size``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, embedding_patterns())
