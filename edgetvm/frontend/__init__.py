"""The ONNX front end of edgetvm: ONNX file -> Relax module with symbolic lengths.

``import_onnx`` reads and validates the model (``loader``), refuses unsupported ops up
front, and converts with TVM's Relax importer plus edgetvm's converter overrides
(``dynamic_shape_fixes``, ``matmul_nbits``), scoped to the call.
"""

from .importer import ImportedModel, import_onnx

__all__ = ["ImportedModel", "import_onnx"]
