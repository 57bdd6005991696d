"""ProgramBuilder: the one way code (lowering, tests, benchmarks) assembles a Program."""
from __future__ import annotations

import numpy as np

from .isa import (DTYPES, TENSOR_KINDS, Affine, Command, DramRef, End, Program, TcmRef,
                  TensorDecl)


class ProgramBuilder:
    """Collects tensors, TCM regions, events and commands, then builds a :class:`Program`.

    TCM regions from :meth:`tcm` are bump-allocated (aligned); a real lifetime-based
    allocator hands out offsets itself and passes them to :class:`TcmRef` directly.
    """

    def __init__(self, name: str, spec=None):
        self.name = name
        self.spec = spec
        self.commands: list[Command] = []
        self.tensors: dict[str, TensorDecl] = {}
        self.params: list[str] = []
        self._tcm_top = 0
        self._tcm_high = 0
        self._events = 0
        self.alignment = spec.tcm_alignment if spec is not None else 64

    # -- DRAM -------------------------------------------------------------------------
    def tensor(self, name: str, shape, dtype: str, kind: str, data=None) -> str:
        if kind not in TENSOR_KINDS:
            raise ValueError(f"tensor {name!r}: kind must be one of {TENSOR_KINDS}")
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype must be one of {DTYPES}")
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} declared twice")
        shape = tuple(int(s) for s in shape)
        if data is not None:
            data = np.ascontiguousarray(data, dtype=dtype)
            if data.shape != shape:
                raise ValueError(f"tensor {name!r}: data shape {data.shape} != {shape}")
        elif kind == "const":
            raise ValueError(f"const tensor {name!r} needs data")
        self.tensors[name] = TensorDecl(name, shape, dtype, kind, data)
        return name

    def dram(self, name: str, row0=0, col0=0, rows=None, cols=None) -> DramRef:
        """A 2-D window of a DRAM tensor viewed as (prod(shape[:-1]), shape[-1])."""
        t = self.tensors[name]
        width = t.shape[-1] if len(t.shape) else 1
        height = int(np.prod(t.shape[:-1], dtype=np.int64)) if len(t.shape) > 1 else 1
        rows = height if rows is None else rows
        cols = width if cols is None else cols
        return DramRef(name, (rows, cols), width, row0 * width + col0)

    # -- TCM, events, params ------------------------------------------------------------
    def tcm(self, shape, dtype: str) -> TcmRef:
        a = self.alignment
        off = (self._tcm_top + a - 1) // a * a
        ref = TcmRef(off, tuple(int(s) for s in shape), dtype)
        self._tcm_top = ref.end
        self._tcm_high = max(self._tcm_high, self._tcm_top)
        return ref

    def reset_tcm(self) -> None:
        """Free every bump-allocated region (e.g. between kernels)."""
        self._tcm_top = 0

    def event(self) -> int:
        self._events += 1
        return self._events - 1

    def param(self, name: str) -> Affine:
        if name not in self.params:
            self.params.append(name)
        return Affine.param(name)

    # -- commands -----------------------------------------------------------------------
    def emit(self, cmd: Command) -> int:
        self.commands.append(cmd)
        return len(self.commands) - 1

    def build(self, tcm_bytes: int | None = None, **metadata) -> Program:
        cmds = list(self.commands)
        if not cmds or not isinstance(cmds[-1], End):
            cmds.append(End())
        return Program(self.name, cmds, dict(self.tensors), tuple(self.params),
                       tcm_bytes if tcm_bytes is not None else self._tcm_high,
                       self.spec.hash() if self.spec is not None else "", dict(metadata))
