"""ONNX -> Relax: TVM's importer with edgetvm's converter overrides.

``EdgeONNXImporter`` subclasses TVM's ``ONNXGraphImporter`` and consults edgetvm's
converters (dynamic-shape fixes, MatMulNBits) before TVM's converter map. The overrides
therefore exist only inside one :func:`import_onnx` call: nothing in TVM is patched,
other users of ``tvm.relax.frontend.onnx`` in the same process are unaffected.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import onnx
import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend

from edgetvm.errors import ModelImportError

from .clip import convert_clip, convert_max, convert_min
from .constant_folding import fold_constant_node
from .einsum import convert_einsum
from .dynamic_shape_fixes import DYNAMIC_SHAPE_FIXES
from .io_casts import fold_io_casts
from .loader import load_model, op_histogram
from .matmul_nbits import convert_matmul_nbits
from .shape_overrides import apply_shape_overrides

#: op_type -> converter ``(bb, inputs, attrs, params, fallback)``. Keyed by op_type only
#: because TVM's importer does not pass the domain; the loader has already refused
#: every node whose (domain, op_type) is not supported, so "MatMulNBits" here is
#: always com.microsoft's.
CONVERTER_OVERRIDES = {**DYNAMIC_SHAPE_FIXES, "MatMulNBits": convert_matmul_nbits,
                       "Clip": convert_clip, "Max": convert_max, "Min": convert_min,
                       "Einsum": convert_einsum}

# TVM warns for every renamed input (dots) and every dynamic dimension: expected here.
_EXPECTED_TVM_WARNINGS = ("Renaming name", "has unknown dimension shapes")


@dataclass
class ImportedModel:
    """A Relax module imported from ONNX, with what later stages need to know about it.

    Attributes
    ----------
    mod : tvm.IRModule
        ``main`` takes the graph inputs (weights are bound as constants) and returns the
        graph outputs (a tuple when there are several, in ``output_names`` order).
    input_names : list of str
        ONNX graph input names, in the order of ``main``'s parameters (the Relax
        parameter names are the same with ``.`` replaced by ``_``).
    output_names : list of str
        ONNX graph output names.
    tir_vars : dict of str to tvm.tirx.Var
        The symbolic dimensions of ``main``'s inputs by name (e.g. ``batch_size``,
        ``sequence_length``, ``past_sequence_length``).
    opset : int
        The model's default-domain opset.
    op_histogram : dict of str to int
        Number of ONNX nodes per op type (``"domain:Op"`` outside the default domain).
    source : str
        The file the model came from (or ``"<ModelProto>"``).
    output_dtypes : dict of str to str
        The numpy dtype each float output has in the file, where the graph computes it
        in another width (a cast at the output folded: :mod:`~edgetvm.frontend.io_casts`).
    """

    mod: tvm.IRModule
    input_names: list[str]
    output_names: list[str]
    tir_vars: dict[str, tirx.Var]
    opset: int
    op_histogram: dict[str, int] = field(default_factory=dict)
    source: str = "<ModelProto>"
    output_dtypes: dict[str, str] = field(default_factory=dict)


class EdgeONNXImporter(onnx_frontend.ONNXGraphImporter):
    """TVM's ONNX graph importer, with :data:`CONVERTER_OVERRIDES` taking precedence."""

    def __init__(self, shape_dict=None, dtype_dict="float32"):
        super().__init__(shape_dict, dtype_dict, keep_params_in_input=False, sanitize=True)
        self.current_node = None
        self._tile_repeats_nodes = set()
        self._node_protos = {}

    def _construct_nodes(self, graph):
        # TVM refuses a shape (``ShapeExpr``) as input of any op outside its short list of
        # shape-aware ops, Tile among them, before a converter is consulted. A value that
        # only Tile reads as its repeats is therefore handed over as ``shape_to_tensor``
        # of the shape, which :func:`~.dynamic_shape_fixes.convert_tile` sees through.
        self._node_protos = {node.name: node for node in graph.node if node.name}
        readers = {}
        for node in graph.node:
            for index, name in enumerate(node.input):
                readers.setdefault(name, []).append((node.op_type, index))
        self._tile_repeats_nodes = {
            node.name
            for node in graph.node
            if node.name
            and len(node.output) == 1
            and readers.get(node.output[0])
            and all(reader == ("Tile", 1) for reader in readers[node.output[0]])
        }
        return super()._construct_nodes(graph)

    def _check_for_unsupported_ops(self, graph):
        # The loader checked already, knowing domains and edgetvm's additions.
        pass

    def _convert_operator(self, op_name, inputs, attrs, opset):
        self.current_node = (op_name, attrs.get("tvm_custom", {}).get("name", ""))
        proto = self._node_protos.get(self.current_node[1])
        if proto is not None and proto.op_type == op_name:
            folded = fold_constant_node(proto, inputs, opset)
            if folded is not None:
                return folded
        override = CONVERTER_OVERRIDES.get(op_name)

        def fallback():
            return super(EdgeONNXImporter, self)._convert_operator(op_name, inputs, attrs, opset)

        if override is None:
            result = fallback()
        else:
            result = override(self.bb, inputs, attrs, [self._nodes, self._params], fallback)
        if self.current_node[1] in self._tile_repeats_nodes and isinstance(
            getattr(result, "ty", None), relax.ShapeType
        ):
            return self.bb.normalize(relax.op.shape_to_tensor(result))
        if isinstance(result, relax.Call) and result.span is None and self.current_node[1]:
            # the ONNX node's name as the call's span: later errors can name the node
            span = tvm.ir.Span(tvm.ir.SourceName(self.current_node[1]), 0, 0, 0, 0)
            return self.bb.normalize(
                relax.Call(result.op, result.args, result.attrs, result.ty_args, span))
        if override is None:
            return result
        return self.bb.normalize(result) if isinstance(result, relax.Expr) else result


def import_onnx(
    path_or_model, *, shape_overrides: Mapping[str, int | Sequence[int | str]] | None = None
) -> ImportedModel:
    """Import an ONNX model into Relax with symbolic sequence / past lengths.

    Parameters
    ----------
    path_or_model : str, os.PathLike or onnx.ModelProto
        The model.
    shape_overrides : mapping, optional
        Dynamic dimensions to fix, by dimension name (``{"batch_size": 1}``) or by input
        name (``{"input_ids": [1, "sequence_length"]}``); see
        :func:`~edgetvm.frontend.shape_overrides.apply_shape_overrides`. Not needed for
        the supported LLM exports: batch, sequence and past lengths all stay symbolic.

    Returns
    -------
    ImportedModel

    Raises
    ------
    ModelImportError
        Unreadable, truncated or invalid file, or a conversion failure (naming the node).
    UnsupportedOpsError
        The model uses ops edgetvm cannot compile (all listed, before any conversion).
    """
    loaded = load_model(path_or_model)
    model = fold_io_casts(_with_unique_node_names(loaded.model))
    declared = {v.name: v.type.tensor_type.elem_type for v in loaded.model.graph.output}
    output_dtypes = {v.name: onnx.helper.tensor_dtype_to_np_dtype(declared[v.name]).name
                     for v in model.graph.output
                     if declared.get(v.name) != v.type.tensor_type.elem_type}
    if shape_overrides:
        model = apply_shape_overrides(model, shape_overrides, loaded.source)

    importer = EdgeONNXImporter()
    with warnings.catch_warnings():
        for message in _EXPECTED_TVM_WARNINGS:
            warnings.filterwarnings("ignore", message=f".*{message}.*")
        try:
            mod = importer.from_onnx(model.graph, loaded.opset)
        except Exception as err:  # TVM raises anything from TVMError to AssertionError
            op, node = importer.current_node or ("?", "?")
            detail = str(err).strip().splitlines()
            error = ModelImportError(
                f"{loaded.source}: converting node {node!r} ({op}) failed: "
                f"{detail[0] if detail else type(err).__name__}"
            )
            # Kept for debugging, but not chained: users get one message, no TVM traceback.
            error.tvm_error = err
            raise error from None

    initializers = {init.name for init in model.graph.initializer}
    return ImportedModel(
        mod=mod,
        input_names=[value.name for value in model.graph.input if value.name not in initializers],
        output_names=[value.name for value in model.graph.output],
        tir_vars=_input_tir_vars(mod["main"]),
        opset=loaded.opset,
        op_histogram=op_histogram(model),
        source=loaded.source,
        output_dtypes=output_dtypes,
    )


def _with_unique_node_names(model):
    """The model itself when its nodes have unique names, else a copy in which every
    unnamed or repeated node is named ``<op_type>_<index>``: errors name the node, and the
    importer keys what it knows of a node (its readers) by name."""
    names = [node.name for node in model.graph.node]
    if all(names) and len(set(names)) == len(names):
        return model
    copy = type(model)()
    copy.CopyFrom(model)
    taken = set()
    for index, node in enumerate(copy.graph.node):
        if not node.name or node.name in taken:
            node.name = f"{node.op_type}_{index}"
            while node.name in taken:
                node.name += "_"
        taken.add(node.name)
    return copy


def _input_tir_vars(func: relax.Function) -> dict[str, tirx.Var]:
    # Symbolic vars defined by the parameters' shapes: the model's dynamic dimensions.
    return {var.name: var for var in relax.analysis.defined_symbolic_vars(func)}
