"""What a model's linears weigh on the NPU: bits per weight and DRAM bytes per token.

Counted from the Relax module (after ``QuantizeW4A16``, or as imported from a MatMulNBits
export), in the formats the NPU keeps in DRAM (``edgetvm/npu_regions.py``): a W4A16
linear moves its packed codes (4 bits per weight, K padded to whole groups), one float16
scale per group and, by its zero-point form, nothing, one uint8 or one float16 zero point
per group; a float linear moves float16 weights; the embedding is a gather of one float16
row per token. Decode reads every linear's weights once per token, so their sum is the
weight traffic of one decoded token (activations and the KV cache come on top).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from .quantize_w4a16 import _const_weight, _op_name, _static_shape

_ZERO_POINT_BYTES = {"none": 0, "uint4": 1, "float": 2}
_Constant = tvm.ir.expr.GenericConst


@dataclass
class QuantReport:
    """Linears and embedding of a module, as the NPU stores them.

    Attributes
    ----------
    w4_linears, w4_weights, w4_bytes : int
        W4A16 linears: how many, their ``K x N`` weights, their DRAM bytes.
    float_linears, float_weights : int
        Linears with a constant float weight (kept float: fp16 on the NPU, 2 bytes each).
    embedding_row_bytes : int
        Bytes of the embedding rows one token gathers (fp16).
    zero_point_kinds, group_sizes : set
        Forms of the W4A16 linears.
    """

    w4_linears: int = 0
    w4_weights: int = 0
    w4_bytes: int = 0
    float_linears: int = 0
    float_weights: int = 0
    embedding_row_bytes: int = 0
    zero_point_kinds: set = field(default_factory=set)
    group_sizes: set = field(default_factory=set)

    @property
    def float_bytes(self) -> int:
        return 2 * self.float_weights

    @property
    def bits_per_weight(self) -> float:
        """DRAM bits per W4A16 weight (codes, scales and zero points; 0 without any)."""
        return 8.0 * self.w4_bytes / self.w4_weights if self.w4_weights else 0.0

    @property
    def weight_bytes_per_token(self) -> int:
        """Weight bytes one decoded token reads: every linear once, one embedding row."""
        return self.w4_bytes + self.float_bytes + self.embedding_row_bytes

    def summary(self) -> str:
        """Three lines for a user."""
        forms = (", ".join(f"g{g}" for g in sorted(self.group_sizes)) + " " +
                 "/".join(sorted(self.zero_point_kinds)) + " zero points") if self.w4_linears \
            else "none"
        return (f"W4A16 linears: {self.w4_linears} ({self.w4_weights / 1e6:.2f} M weights, "
                f"{self.bits_per_weight:.2f} bits/weight, {self.w4_bytes / 1e6:.2f} MB; {forms})\n"
                f"fp16 linears:  {self.float_linears} ({self.float_weights / 1e6:.2f} M weights, "
                f"{self.float_bytes / 1e6:.2f} MB); embedding: fp16, "
                f"{self.embedding_row_bytes} B per token\n"
                f"weight DRAM bytes per decoded token: {self.weight_bytes_per_token / 1e6:.2f} MB")


def quantization_report(mod: tvm.IRModule) -> QuantReport:
    """Count the linears and the embedding of every Relax function of ``mod``."""
    report = QuantReport()
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        bound = {}
        for block in func.body.blocks:
            for b in block.bindings:
                if isinstance(b, relax.VarBinding):
                    bound[b.var] = b.value
        for value in bound.values():
            _count(value, bound, mod, report)
    return report


def _count(value, bound: dict, mod: tvm.IRModule, report: QuantReport) -> None:
    name = _op_name(value)
    if name == "relax.matmul":
        weight = _const_weight(value.args[1], bound)
        if weight is not None:
            report.float_linears += 1
            report.float_weights += int(weight.size)
    elif name == "relax.take" and isinstance(value.args[0], _Constant):
        shape = _static_shape(value.args[0])
        if shape and len(shape) == 2 and str(value.args[0].ty.dtype).startswith("float"):
            report.embedding_row_bytes += 2 * shape[1]
    elif name == "relax.call_tir":
        callee = mod[value.args[0]]
        attrs = callee.attrs
        if attrs is None or str(attrs.get("edgetvm.op", "")) != "linear_w4a16":
            return
        a, packed = callee.params[0], callee.params[1]    # TVM 0.27: Vars of BufferType
        n, k_blocks, half = (int(d) for d in packed.shape)
        kind = str(attrs.get("edgetvm.zero_point_kind", "none"))
        groups = n * k_blocks
        report.w4_linears += 1
        report.w4_weights += n * int(a.shape[-1])
        report.w4_bytes += groups * half + groups * (2 + _ZERO_POINT_BYTES[kind])
        report.zero_point_kinds.add(kind)
        report.group_sizes.add(int(attrs["edgetvm.group_size"]))
