"""AnnotateKVAppend: appending the new keys/values to the past KV cache."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_tuple, wildcard

from ._fusion import RegionPattern, call, fuse_regions, head_split, static_shape


def kv_append_patterns() -> list[RegionPattern]:
    """``concat((past, new), axis=seq)`` where ``past`` is a function parameter (the
    ``past_key_values.N.key/value`` input) of rank 4 (batch, kv_heads, seq, head_dim);
    the head split of ``new`` (values come straight from their projection) is absorbed."""
    past, new = wildcard(), wildcard()
    append = call("relax.concat", is_tuple([past, head_split(new)]))

    def check(m, ctx):
        past_var = ctx.matched_expr.args[0].fields[0]
        if not isinstance(past_var, relax.Var) or isinstance(past_var, relax.DataflowVar):
            return False
        shape = static_shape(past_var)
        axis = int(ctx.matched_expr.attrs.axis)
        return len(shape) == 4 and axis in (2, -2)

    def attrs(m):
        _, kv_heads, total_len, head_dim = static_shape(m["root"])
        past_len = static_shape(m["past"])[2]
        name = str(m["past"].name) if isinstance(m["past"], relax.Var) else ""
        # past_key_values.N.key / .value (the importer turns dots into underscores)
        last = name.replace(".", "_").rsplit("_", 1)[-1]
        cache = last if last in ("key", "value") else "kv"
        return {
            "num_kv_heads": kv_heads,
            "head_dim": head_dim,
            "past_len": past_len,
            "total_len": total_len,
            "cache": cache,
        }

    return [RegionPattern("kv_append", append, {"past": past, "new": new, "root": append}, check, attrs)]


@tvm.transform.module_pass(opt_level=0, name="AnnotateKVAppend")
class AnnotateKVAppend:
    """Group the KV-cache appends into ``edgetvm.kv_append`` composites.

    In the with-past export the cache is a graph input and the grown cache a graph
    output, joined by a concat along the sequence axis. The state & layout passes replace
    exactly these regions by an in-place write into persistent KV pages, so they are
    marked here. Attributes: ``num_kv_heads``, ``head_dim``, ``past_len``, ``total_len``, ``cache`` (key/value, from the input name).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, kv_append_patterns())
