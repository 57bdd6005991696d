"""What the semantic passes recognised: per-layer region counts, FLOPs and coverage."""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from ._fusion import ATTR_PREFIX, COMPOSITE_PREFIX, main_functions
from .flops import function_flops, is_glue, op_flops

COVERAGE_DEFINITION = (
    "coverage = FLOPs inside recognised regions / FLOPs of all Relax calls; NPU share = "
    "FLOPs inside regions that run on the NPU / FLOPs of all Relax calls "
    "(matmul and W4A16 linear: 2*M*N*K; other floating-point compute: 1 per element; "
    "data movement and index/shape/boolean-mask arithmetic: 0 FLOPs, listed as glue ops)"
)
_NORMS = ("rms_norm", "layer_norm")


@dataclass
class _Unit:
    """One call of the entry function: a recognised region or a single op."""

    kind: str
    recognised: bool
    glue: bool
    flops: int
    attrs: dict
    inputs: set
    npu: bool = False
    unknown_shape: bool = False


@dataclass
class LayerSummary:
    """One row of the report.

    Attributes
    ----------
    label : str
        ``"pre"`` (before the first layer), the layer index, ``"head"`` (final norm,
        lm_head) or ``"model"`` when no attention layer was found.
    regions : dict
        Region kind -> count. ``linear`` includes the projections inside MLP regions.
    recognised_flops, generic_flops : int
        FLOPs inside recognised regions / in compute ops outside any region.
    npu_flops : int
        FLOPs inside regions that run on the NPU (when the report was given the offload
        decisions).
    host_regions : dict
        Region kind -> count of recognised regions that run on the host.
    generic_ops : dict
        Op name -> count of compute ops outside any region.
    glue_ops : int
        Data-movement / index ops outside any region (0 FLOPs by definition).
    """

    label: str
    regions: dict = field(default_factory=dict)
    recognised_flops: int = 0
    generic_flops: int = 0
    npu_flops: int = 0
    host_regions: dict = field(default_factory=dict)
    generic_ops: dict = field(default_factory=dict)
    glue_ops: int = 0


@dataclass
class SemanticReport:
    """Recognition report of one entry function (see ``COVERAGE_DEFINITION``)."""

    function: str
    layers: list
    region_attrs: list  # (kind, attrs) for every recognised region, in program order
    npu_known: bool = False        # were the offload decisions given?
    unknown_shapes: int = 0        # compute calls whose shapes are unknown (not counted)

    @property
    def recognised_flops(self) -> int:
        return sum(row.recognised_flops for row in self.layers)

    @property
    def npu_flops(self) -> int:
        return sum(row.npu_flops for row in self.layers)

    @property
    def npu_share(self) -> float:
        """Share of FLOPs in regions that run on the NPU, 0..1."""
        total = self.total_flops
        return self.npu_flops / total if total else 0.0

    def host_region_counts(self) -> dict:
        """Region kind -> count of recognised regions that stay on the host."""
        total: dict = {}
        for row in self.layers:
            for kind, n in row.host_regions.items():
                total[kind] = total.get(kind, 0) + n
        return total

    @property
    def total_flops(self) -> int:
        return sum(row.recognised_flops + row.generic_flops for row in self.layers)

    @property
    def coverage(self) -> float:
        """Share of FLOPs in recognised regions, 0..1 (0 for a graph without FLOPs)."""
        total = self.total_flops
        return self.recognised_flops / total if total else 0.0

    def counts(self) -> dict:
        """Region kind -> count over the whole function."""
        total: dict = {}
        for row in self.layers:
            for kind, n in row.regions.items():
                total[kind] = total.get(kind, 0) + n
        return total

    def format_table(self) -> str:
        """The per-layer table printed by ``python -m edgetvm.inspect``."""
        lines = [f"function {self.function}"]
        npu_col = f" {'NPU MFLOP':>9}" if self.npu_known else ""
        header = (f"{'layer':<6} {'recognised regions':<72} {'rec. MFLOP':>10}{npu_col} "
                  f"{'generic MFLOP':>13} {'glue ops':>8}")
        lines += [header, "-" * len(header)]
        for row in self.layers:
            regions = " ".join(f"{k}x{n}" for k, n in row.regions.items()) or "-"
            npu = f" {row.npu_flops / 1e6:>9.3f}" if self.npu_known else ""
            lines.append(
                f"{row.label:<6} {regions:<72} {row.recognised_flops / 1e6:>10.3f}{npu} "
                f"{row.generic_flops / 1e6:>13.3f} {row.glue_ops:>8}"
            )
            if row.host_regions:
                host = " ".join(f"{k}x{n}" for k, n in row.host_regions.items())
                lines.append(f"{'':<6} recognised, on the host: {host}")
            if row.generic_ops:
                generic = " ".join(f"{k}x{n}" for k, n in row.generic_ops.items())
                lines.append(f"{'':<6} generic (not recognised, on the host): {generic}")
        lines.append("-" * len(header))
        total = self.total_flops
        if self.recognised_flops == 0:
            lines.append(
                f"generic: 100% of FLOPs not recognised ({total / 1e6:.3f} MFLOP); "
                "architecture unknown, compiled by the generic Relax path"
            )
        else:
            lines.append(
                f"coverage: {100 * self.coverage:.2f} % of {total / 1e6:.3f} MFLOP in recognised regions"
                f" ({(total - self.recognised_flops) / 1e6:.3f} MFLOP generic)"
            )
        if self.npu_known:
            lines.append(
                f"NPU share: {100 * self.npu_share:.2f} % of {total / 1e6:.3f} MFLOP run on the "
                f"NPU ({(total - self.npu_flops) / 1e6:.3f} MFLOP on the host)"
            )
        if self.unknown_shapes:
            lines.append(
                f"warning: {self.unknown_shapes} compute call(s) have shapes the importer lost "
                "(only the rank is known); their FLOPs are counted as if every dimension were 1, "
                "so coverage and NPU share may be overstated"
            )
        return "\n".join(lines)


def _region_info(mod: tvm.IRModule, call: relax.Call):
    """(kind, attrs) if ``call`` calls an edgetvm composite, else None."""
    if not isinstance(call.op, relax.GlobalVar):
        return None
    func = mod[call.op]
    if not isinstance(func, relax.Function) or func.attrs is None:
        return None
    name = str(func.attrs.get("Composite", ""))
    if not name.startswith(COMPOSITE_PREFIX):
        return None
    attrs = {
        str(k)[len(ATTR_PREFIX):]: str(v)
        for k, v in func.attrs.items()
        if str(k).startswith(ATTR_PREFIX)
    }
    return name[len(COMPOSITE_PREFIX):], attrs


def _shape_unknown(expr) -> bool:
    ty = expr.ty
    if isinstance(ty, relax.TupleType):
        return False
    return isinstance(ty, relax.TensorType) and (ty.shape is None or
                                                  getattr(ty.shape, "values", None) is None)


def _units(mod: tvm.IRModule, func: relax.Function, dims: dict, on_npu) -> list:
    units: list = []
    regions = 0           # composite calls so far: the offload pass numbers regions so
    producers: dict = {}  # var -> set of unit indices producing it
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            inputs = set()
            for var in relax.analysis.free_vars(value):
                inputs |= producers.get(var, set())
            if isinstance(value, relax.Call) and not isinstance(value.op, tvm.ir.Op):
                info = _region_info(mod, value)
                if info is None:  # a call to another Relax function: not analysed
                    producers[binding.var] = inputs
                    continue
                kind, attrs = info
                flops = function_flops(mod, mod[value.op], dims)
                unknown = any(_shape_unknown(a) for a in value.args) or _shape_unknown(value)
                units.append(_Unit(kind, True, False, flops, attrs, inputs,
                                   npu=regions in on_npu, unknown_shape=unknown))
                regions += 1
            elif isinstance(value, relax.Call):
                glue = is_glue(value)
                unknown = not glue and (_shape_unknown(value) or
                                        any(_shape_unknown(a) for a in value.args
                                            if isinstance(a, relax.Expr)))
                units.append(_Unit(value.op.name.removeprefix("relax."), False, glue,
                                   op_flops(mod, value, dims), {}, inputs,
                                   unknown_shape=unknown))
            else:  # tuples, tuple items, aliases: no work, pass producers through
                producers[binding.var] = inputs
                continue
            producers[binding.var] = {len(units) - 1}
    return units


def _layer_labels(units: list) -> list:
    """Layer label of each unit.

    A layer starts at the normalisation feeding an attention region (the nearest norm
    among the attention's ancestors). A unit's layer is the number of such norms among
    its ancestors (and itself) minus one; units before the first are ``pre``, units after
    the last residual add of the last layer are ``head``.
    """
    ancestors = []
    for unit in units:
        mask = 0
        for j in unit.inputs:
            mask |= ancestors[j] | (1 << j)
        ancestors.append(mask)
    starts = 0
    for i, unit in enumerate(units):
        if unit.kind == "attention":
            norms = [j for j in range(i) if ancestors[i] >> j & 1 and units[j].kind in _NORMS]
            if norms:
                starts |= 1 << max(norms)
    if not starts:
        return ["model"] * len(units)
    num_layers = bin(starts).count("1")
    labels = []
    for i in range(len(units)):
        depth = bin((ancestors[i] | 1 << i) & starts).count("1")
        labels.append("pre" if depth == 0 else str(depth - 1))
    last = str(num_layers - 1)
    closing = [i for i, u in enumerate(units) if u.kind == "residual_add" and labels[i] == last]
    for i, unit in enumerate(units):
        if labels[i] == last and (unit.kind == "lm_head" or (closing and i > max(closing))):
            labels[i] = "head"
    return labels


def semantic_report(
    mod: tvm.IRModule, function: str | None = None, dims: dict | None = None,
    on_npu=None,
) -> SemanticReport:
    """Report the recognised regions of an annotated module.

    Parameters
    ----------
    mod : tvm.IRModule
        A module after ``AnnotateLLMSemantics`` (or any subset of the passes).
    function : str, optional
        Entry function to report; default the first non-composite Relax function.
    dims : dict, optional
        Values of symbolic dimensions for FLOP counting (default 1 each).
    on_npu : set of int, optional
        Which regions run on the NPU, by their position among the function's region calls
        (``Region.index`` of ``edgetvm.offload``); without it the report has no NPU share.

    Returns
    -------
    SemanticReport
    """
    entries = dict((gv.name_hint, f) for gv, f in main_functions(mod))
    if function is None:
        function = "main" if "main" in entries else next(iter(entries))
    units = _units(mod, entries[function], dims or {}, on_npu or set())
    labels = _layer_labels(units)
    order = ["pre"] + sorted({l for l in labels if l.isdigit()}, key=int) + ["head", "model"]
    rows = {label: LayerSummary(label) for label in order if label in labels}
    for unit, label in zip(units, labels):
        row = rows[label]
        if unit.recognised:
            row.regions[unit.kind] = row.regions.get(unit.kind, 0) + 1
            nested = int(unit.attrs.get("num_linears", 0))
            if nested:
                row.regions["linear"] = row.regions.get("linear", 0) + nested
            row.recognised_flops += unit.flops
            if unit.npu:
                row.npu_flops += unit.flops
            elif on_npu is not None:
                row.host_regions[unit.kind] = row.host_regions.get(unit.kind, 0) + 1
        elif unit.glue:
            row.glue_ops += 1
        else:
            row.generic_ops[unit.kind] = row.generic_ops.get(unit.kind, 0) + 1
            row.generic_flops += unit.flops
    regions = [(u.kind, u.attrs) for u in units if u.recognised]
    return SemanticReport(function, list(rows.values()), regions, npu_known=on_npu is not None,
                          unknown_shapes=sum(u.unknown_shape for u in units))
