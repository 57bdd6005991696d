"""The NPU command-stream ISA.

A program is a flat list of commands. Each command runs on one unit (``dma0``..``dmaN``,
``matrix``, ``vector``, ``host``); units issue their own commands in program order and
synchronise only through events. Every command carries:

``wait``
    event ids it waits on before starting (an id listed twice waits for two signals).
``signal``
    event ids it signals when it completes.

Events: an event is a counting semaphore from ONE signalling unit to ONE waiting unit
(commands on other units may not signal or wait on it; the validator refuses programs that
do). The k-th wait on the event, in the waiting unit's program order, consumes the k-th
signal, in the signalling unit's program order, and orders the waiting command after the
signalling command and everything before it on its unit. So which signal a wait consumes,
and with it every happens-before relation the race check uses, never depends on timing.
``when``
    optional predicate: an :class:`Affine` of runtime parameters, or a tuple of them; the
    command executes iff every value is > 0 (a tile that is live AND on the diagonal: a
    command processor comparing scalar registers, as for a loop bound). A predicated-off
    command moves no data and takes no cycles, but still waits and signals, so the event
    protocol is the same for every parameter value.

Operands are :class:`TcmRef` (a 2-D region of the TCM: byte offset, rows x cols, dtype,
row stride in elements) or :class:`DramRef` (a 2-D strided window of a named DRAM tensor
of the program's tensor table; its element offset may depend on runtime parameters).

Commands
--------
``DmaLoad`` / ``DmaStore``
    2-D strided copy DRAM -> TCM / TCM -> DRAM on one DMA channel; bytes are copied as they
    are (the dtypes must match). ``valid_rows`` (an Affine, clipped to ``[0, rows]``) is the
    runtime repeat count: only that many rows move.
``Mma``
    ``out (M, N) [+]= a (M, K) @ b`` with fp32 accumulation (int32 for int8 x int8).
    ``b`` is ``(K, N)``, or ``(N, K)`` with ``transpose_b``. Kinds, by operand dtypes:
    fp16 x fp16; int8 x int8; fp16 x W4: ``b`` is uint8 ``(N, K // 2)`` (two 4-bit weights
    per byte, the even k in the low nibble, as onnxruntime's MatMulNBits), ``scales``
    ``(N, K // group_size)`` float16 and optional ``zeros`` ``(N, K // group_size)``,
    uint8 (integer zero points) or float16 (float zero points, MatMulNBits' float form);
    default zero point 8: ``w[n, k] = (q[n, k] - zero) * scale`` in fp32, dequantised on
    the fly.
``Vector``
    an elementwise, reduction or fused op on the vector unit, computed in fp32 and stored
    in ``dst``'s dtype; see :data:`VECTOR_OP_ARITY`. Binary ops broadcast a second operand
    of shape ``(rows, 1)`` or ``(1, cols)``, or use the scalar ``imm``. ``alibi``
    (attention with linear biases, Press et al. 2022) adds ``slope[row] * (col - origin)``
    to scores ``x``: ``slope`` is ``(rows, 1)`` or ``(1, 1)`` (one for every row),
    ``origin`` a value the host may set per run (the key position of the query). Rows of
    a prefill tile are queries at consecutive positions: one ``origin`` for all of them
    differs from each row's own by a constant per row, which the softmax that follows
    cancels. ``mask`` sets to -inf the columns at or past ``limit`` and those whose
    ``col - row`` exceeds ``causal_offset`` (a causal band), and to fp32's lowest finite
    value (-3.4e38, as transformers' masks) those below ``floor`` or whose ``col - row`` is
    below ``window_offset`` (a sliding window's lower edge: finite, so a row whose keys in a
    tile are all behind its window still has a finite maximum there, and an online softmax
    started on that tile is rescaled to nothing, not NaN, by the first tile it sees).
``EventWait`` / ``EventSignal``
    a no-op on ``unit`` that only waits / signals (to block a unit's queue).
``HostOp``
    a fallback op run on the host CPU over whole DRAM tensors (see ``host_ops.py``).
``Launch``
    a kernel boundary: waits until every unit is idle, then costs the spec's
    ``launch_cycles`` (reconfiguration). Fusing kernels saves launches. The TCM keeps its
    contents, but a kernel may read only bytes it wrote since its launch, or that its
    launch ``carry``-s (TCM regions a DMA filled for it before the launch: a prefetch of
    its first weights while the previous kernel computed), unless the launch says
    ``keep_tcm`` (a kernel that reuses data an earlier one left, by design).
``End``
    the end of the program: waits until every unit is idle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Union

import numpy as np

from .spec import EMULATOR_MODEL_VERSION

#: element types the ISA knows (numpy names)
DTYPES = ("float16", "float32", "int8", "int32", "uint8")
ITEMSIZE = {d: np.dtype(d).itemsize for d in DTYPES}

#: vector ops and how many TCM sources each takes (``imm`` may replace a binary's 2nd)
VECTOR_OP_ARITY = {
    "add": 2, "sub": 2, "mul": 2, "max": 2, "div": 2,  # elementwise, broadcasting 2nd operand
    "reduce_max": 1, "reduce_sum": 1,                 # along cols: (R, C) -> (R, 1)
    "exp": 1, "rsqrt": 1, "silu": 1, "gelu": 1,       # unary; rsqrt(x + imm), exp(x * imm)
    "exp_sub": 2,                                     # exp((x - y) * imm), y broadcasting
    "gelu_tanh": 1,                                   # GELU, erf form / tanh approximation
    "cast": 1, "copy": 1,
    "rope": 3,                                        # x*cos + rotate_half(x)*sin, (x, cos, sin)
    "rope_pairs": 3,                                  # x*cos + rotate_pairs(x)*sin (GPT-J form)
    "mask": 1,                                        # -inf outside limit / causal band
    "alibi": 2,                                       # x + slope[row] * (col - origin)
}


@dataclass(frozen=True)
class Affine:
    """``const + sum(coef * params[name])``: a value the host sets per invocation."""

    const: int = 0
    terms: tuple = ()   # ((param_name, coef), ...)

    @staticmethod
    def param(name: str, coef: int = 1, const: int = 0) -> "Affine":
        return Affine(const, ((name, coef),))

    def eval(self, params: Mapping[str, int]) -> int:
        v = self.const
        for name, coef in self.terms:
            v += coef * params[name]
        return v

    def names(self) -> tuple:
        return tuple(n for n, _ in self.terms)

    def __add__(self, other):
        other = as_affine(other)
        terms = dict(self.terms)
        for n, c in other.terms:
            terms[n] = terms.get(n, 0) + c
        return Affine(self.const + other.const, tuple((n, c) for n, c in terms.items() if c))

    __radd__ = __add__

    def __sub__(self, other):
        return self + as_affine(other) * -1

    def __rsub__(self, other):
        return as_affine(other) + self * -1

    def __mul__(self, k: int):
        if isinstance(k, Affine):
            if k.terms and self.terms:
                raise TypeError("a product of two runtime parameters is not affine")
            self, k = (self, k.const) if not k.terms else (k, self.const)
        return Affine(self.const * k, tuple((n, c * k) for n, c in self.terms))

    __rmul__ = __mul__

    def __str__(self):
        parts = [f"{c}*{n}" if c != 1 else n for n, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts)


Value = Union[int, Affine]


def as_affine(v: Value) -> Affine:
    return v if isinstance(v, Affine) else Affine(int(v))


def predicates(when) -> tuple:
    """A command's ``when`` as a tuple of :class:`Affine` predicates (empty: always)."""
    if when is None:
        return ()
    return (when,) if isinstance(when, Affine) else tuple(when)


def holds(when, params: Mapping[str, int]) -> bool:
    """Whether a command with predicate ``when`` executes under ``params``."""
    return all(w.eval(params) > 0 for w in predicates(when))


def eval_value(v: Value | None, params: Mapping[str, int]) -> int | None:
    if v is None or isinstance(v, int):
        return v
    return v.eval(params)


@dataclass(frozen=True)
class TcmRef:
    """A 2-D region of the TCM: ``rows x cols`` elements at byte ``offset``."""

    offset: int
    shape: tuple
    dtype: str
    row_stride: int = 0     # elements between row starts; 0 means ``cols`` (dense)

    @property
    def stride(self) -> int:
        return self.row_stride or self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * ITEMSIZE[self.dtype]

    @property
    def end(self) -> int:
        """One past the last byte touched."""
        rows, cols = self.shape
        return self.offset + ((rows - 1) * self.stride + cols) * ITEMSIZE[self.dtype]

    def rows(self, r0: int, n: int) -> "TcmRef":
        """Rows ``r0 .. r0 + n`` of this region."""
        return TcmRef(self.offset + r0 * self.stride * ITEMSIZE[self.dtype], (n, self.shape[1]),
                      self.dtype, self.stride)

    def cols(self, c0: int, n: int) -> "TcmRef":
        """Columns ``c0 .. c0 + n`` of this region."""
        return TcmRef(self.offset + c0 * ITEMSIZE[self.dtype], (self.shape[0], n), self.dtype,
                      self.stride)


@dataclass(frozen=True)
class DramRef:
    """A 2-D strided window of DRAM tensor ``tensor`` (offsets and strides in elements)."""

    tensor: str
    shape: tuple
    row_stride: int
    offset: Value = 0


@dataclass(frozen=True, kw_only=True)
class Command:
    wait: tuple = ()
    signal: tuple = ()
    when: Affine | tuple | None = None      # a tuple: every predicate must hold

    @property
    def unit(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class DmaLoad(Command):
    dst: TcmRef
    src: DramRef
    channel: int = 0
    valid_rows: Value | None = None

    @property
    def unit(self):
        return f"dma{self.channel}"


@dataclass(frozen=True, kw_only=True)
class DmaStore(Command):
    dst: DramRef
    src: TcmRef
    channel: int = 0
    valid_rows: Value | None = None

    @property
    def unit(self):
        return f"dma{self.channel}"


@dataclass(frozen=True, kw_only=True)
class Mma(Command):
    out: TcmRef
    a: TcmRef
    b: TcmRef
    accumulate: bool = False
    transpose_b: bool = False
    scales: TcmRef | None = None
    zeros: TcmRef | None = None
    group_size: int = 0

    unit = "matrix"

    @property
    def kind(self) -> str:
        """``fp16``, ``int8`` or ``w4a16`` (the key of the spec's MAC rates)."""
        if self.scales is not None:
            return "w4a16"
        return "int8" if self.a.dtype == "int8" else "fp16"

    @property
    def mnk(self) -> tuple:
        m, k = self.a.shape
        n = self.b.shape[0] if self.transpose_b else self.b.shape[1]
        return m, n, k


@dataclass(frozen=True, kw_only=True)
class Vector(Command):
    op: str
    dst: TcmRef
    srcs: tuple
    imm: float | None = None
    limit: Value | None = None           # mask: cols >= limit are masked
    causal_offset: Value | None = None   # mask: col - row > causal_offset are masked
    # a sliding window's lower edge, masked to fp32's lowest finite value (not -inf):
    floor: Value | None = None           # mask: cols < floor
    window_offset: Value | None = None   # mask: col - row < window_offset
    origin: Value | None = None          # alibi: the column whose bias is 0

    unit = "vector"


@dataclass(frozen=True, kw_only=True)
class EventWait(Command):
    on: str     # the unit whose queue this blocks

    @property
    def unit(self):
        return self.on


@dataclass(frozen=True, kw_only=True)
class EventSignal(Command):
    on: str

    @property
    def unit(self):
        return self.on


@dataclass(frozen=True, kw_only=True)
class HostOp(Command):
    fn: str
    inputs: tuple           # DRAM tensor names
    outputs: tuple          # DRAM tensor names
    attrs: tuple = ()       # ((key, value), ...) of JSON scalars
    flops: int = 0

    unit = "host"


@dataclass(frozen=True, kw_only=True)
class Launch(Command):
    name: str = ""
    #: the kernel reads what earlier kernels left in the TCM (declared reuse); without it,
    #: reading TCM bytes the kernel did not write first is refused
    keep_tcm: bool = False
    #: TCM regions loaded for this kernel before its launch (its first weight tiles,
    #: prefetched while the previous kernel ran): the kernel may read them
    carry: tuple = ()

    unit = "all"


@dataclass(frozen=True, kw_only=True)
class End(Command):
    unit = "all"


COMMAND_TYPES = {c.__name__: c for c in (DmaLoad, DmaStore, Mma, Vector, EventWait, EventSignal,
                                         HostOp, Launch, End)}

TENSOR_KINDS = ("input", "output", "const", "scratch", "state")


@dataclass
class TensorDecl:
    """One entry of a program's DRAM tensor table.

    ``kind``: ``input`` (given per call), ``output`` (returned per call), ``const``
    (weights: shipped inside the program), ``scratch`` (zeroed per call), ``state``
    (persistent on the device across calls, e.g. the KV cache pages).
    """

    name: str
    shape: tuple
    dtype: str
    kind: str
    data: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * ITEMSIZE[self.dtype]


@dataclass
class Program:
    """A compiled NPU program: commands + DRAM tensor table + runtime parameter names."""

    name: str
    commands: list
    tensors: dict
    params: tuple = ()
    tcm_bytes: int = 0          # declared TCM footprint (the allocator's high-water mark)
    spec_hash: str = ""
    metadata: dict = field(default_factory=dict)
    #: the emulator model (timing, power) the program was written and measured under
    emulator_model: int = EMULATOR_MODEL_VERSION

    def tensors_of(self, kind: str) -> list:
        return [t for t in self.tensors.values() if t.kind == kind]

    def renamed(self, mapping: dict) -> "Program":
        """A copy whose DRAM tensors ``old`` are called ``mapping[old]`` (e.g. one lowered
        attention kernel serving every layer, each with its own KV cache state)."""
        import dataclasses

        def ren(v):
            if isinstance(v, DramRef) and v.tensor in mapping:
                return dataclasses.replace(v, tensor=mapping[v.tensor])
            return v
        cmds = []
        for c in self.commands:
            changes = {f.name: ren(getattr(c, f.name)) for f in dataclasses.fields(c)
                       if isinstance(getattr(c, f.name), DramRef)}
            if isinstance(c, HostOp):
                changes["inputs"] = tuple(mapping.get(t, t) for t in c.inputs)
                changes["outputs"] = tuple(mapping.get(t, t) for t in c.outputs)
            cmds.append(dataclasses.replace(c, **changes) if changes else c)
        tensors = {mapping.get(n, n): dataclasses.replace(t, name=mapping.get(n, n))
                   for n, t in self.tensors.items()}
        return dataclasses.replace(self, commands=cmds, tensors=tensors)

    def __len__(self):
        return len(self.commands)
