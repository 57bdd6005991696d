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

import tvm
from tvm import relax, tirx
from tvm.relax.frontend.onnx import onnx_frontend

from edgetvm.errors import ModelImportError

from .dynamic_shape_fixes import DYNAMIC_SHAPE_FIXES
from .loader import load_model, op_histogram
from .matmul_nbits import convert_matmul_nbits
from .shape_overrides import apply_shape_overrides

#: op_type -> converter ``(bb, inputs, attrs, params, fallback)``. Keyed by op_type only
#: because TVM's importer does not pass the domain; the loader has already refused
#: every node whose (domain, op_type) is not supported, so "MatMulNBits" here is
#: always com.microsoft's.
CONVERTER_OVERRIDES = {**DYNAMIC_SHAPE_FIXES, "MatMulNBits": convert_matmul_nbits}

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
    """

    mod: tvm.IRModule
    input_names: list[str]
    output_names: list[str]
    tir_vars: dict[str, tirx.Var]
    opset: int
    op_histogram: dict[str, int] = field(default_factory=dict)
    source: str = "<ModelProto>"


class EdgeONNXImporter(onnx_frontend.ONNXGraphImporter):
    """TVM's ONNX graph importer, with :data:`CONVERTER_OVERRIDES` taking precedence."""

    def __init__(self, shape_dict=None, dtype_dict="float32"):
        super().__init__(shape_dict, dtype_dict, keep_params_in_input=False, sanitize=True)
        self.current_node = None

    def _check_for_unsupported_ops(self, graph):
        # The loader checked already, knowing domains and edgetvm's additions.
        pass

    def _convert_operator(self, op_name, inputs, attrs, opset):
        self.current_node = (op_name, attrs.get("tvm_custom", {}).get("name", ""))
        override = CONVERTER_OVERRIDES.get(op_name)
        if override is None:
            return super()._convert_operator(op_name, inputs, attrs, opset)

        def fallback():
            return super(EdgeONNXImporter, self)._convert_operator(op_name, inputs, attrs, opset)

        result = override(self.bb, inputs, attrs, [self._nodes, self._params], fallback)
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
    model = loaded.model
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
    )


def _input_tir_vars(func: relax.Function) -> dict[str, tirx.Var]:
    # Symbolic vars defined by the parameters' shapes: the model's dynamic dimensions.
    return {var.name: var for var in relax.analysis.defined_symbolic_vars(func)}
