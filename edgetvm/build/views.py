"""Strided views of device tensors: how the graph's glue becomes addressing.

Between two NPU kernels an exported graph reshapes, transposes, slices and splits
activations (head split and merge, a fused QKV projection cut into q, k and v). On the
device none of that moves data: a :class:`View` says where each element of a logical
tensor lives in a DRAM tensor (``offset + sum(index * stride)``, in elements, numpy's
strided-array model), and the glue ops are functions from views to views. A kernel that
reads the glue's result is then *relocated* (``link.py``) to read the producer's tensor
through the view. Only glue that no strided view can express (a reshape of a transposed
view, say) needs a copy, and the caller is told so (``None``).

A view's ``offset`` may depend on runtime parameters (an :class:`~edgetvm.target.isa.Affine`):
a table indexed by the step's position (RoPE's cos/sin rows) is a view whose first row is
``pos``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgetvm.target.isa import Affine, Value, as_affine


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(tuple(shape)):
        strides.append(acc)
        acc *= int(n)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class View:
    """Elements ``index`` of a logical tensor of ``shape`` live at
    ``offset + sum(index * strides)`` of DRAM tensor ``tensor`` (flat, in elements)."""

    tensor: str
    shape: tuple
    strides: tuple
    offset: Affine = Affine(0)

    def __post_init__(self):
        object.__setattr__(self, "offset", as_affine(self.offset))

    @staticmethod
    def whole(tensor: str, shape) -> "View":
        shape = tuple(int(s) for s in shape)
        return View(tensor, shape, contiguous_strides(shape), 0)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_whole(self, shape) -> bool:
        """Is this the whole of a contiguous tensor of ``shape`` (no offset, no gaps)?"""
        return self.offset == Affine(0) and self.size == int(np.prod(shape)) and \
            self.reshape(tuple(shape)) is not None and \
            self.reshape(tuple(shape)).strides == contiguous_strides(shape)

    # -- glue ops ------------------------------------------------------------------------
    def reshape(self, shape) -> "View | None":
        """The same elements in row-major order as ``shape``, or None when that needs a copy
        (numpy's no-copy reshape rule)."""
        shape = tuple(int(s) for s in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        strides = _nocopy_strides(self.shape, self.strides, shape)
        return None if strides is None else View(self.tensor, shape, strides, self.offset)

    def permute(self, axes) -> "View":
        axes = [int(a) % self.ndim for a in axes]
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"permutation {axes} of a rank-{self.ndim} view")
        return View(self.tensor, tuple(self.shape[a] for a in axes),
                    tuple(self.strides[a] for a in axes), self.offset)

    def slice(self, axis: int, begin: int, end: int, step: int = 1) -> "View":
        axis = int(axis) % self.ndim
        n = self.shape[axis]
        begin, end, step = (int(v) for v in slice(begin, end, step).indices(n))
        if step <= 0:
            raise ValueError("views take positive slice steps only")
        length = max(0, -(-(end - begin) // step))
        shape = list(self.shape)
        strides = list(self.strides)
        shape[axis] = length
        strides[axis] = self.strides[axis] * step
        return View(self.tensor, tuple(shape), tuple(strides),
                    self.offset + begin * self.strides[axis])

    def expand_dims(self, axes) -> "View":
        out_ndim = self.ndim + len(axes)
        axes = sorted(int(a) % out_ndim for a in axes)
        shape, strides = list(self.shape), list(self.strides)
        for a in axes:
            shape.insert(a, 1)
            strides.insert(a, 0)
        return View(self.tensor, tuple(shape), tuple(strides), self.offset)

    def squeeze(self, axes=None) -> "View":
        axes = [a for a in range(self.ndim) if self.shape[a] == 1] if axes is None else \
            [int(a) % self.ndim for a in axes]
        if any(self.shape[a] != 1 for a in axes):
            raise ValueError(f"squeeze of axes {axes} of shape {self.shape}")
        keep = [a for a in range(self.ndim) if a not in axes]
        return View(self.tensor, tuple(self.shape[a] for a in keep),
                    tuple(self.strides[a] for a in keep), self.offset)

    def shifted(self, offset: Value) -> "View":
        """The same view ``offset`` elements further (e.g. a table's row at ``pos``)."""
        return View(self.tensor, self.shape, self.strides, self.offset + offset)

    # -- addressing ------------------------------------------------------------------------
    def element_offsets(self) -> np.ndarray:
        """Static flat offset of every element (row-major), without the runtime part."""
        base = self.offset.const
        out = np.full(self.shape, base, np.int64)
        for axis, (n, s) in enumerate(zip(self.shape, self.strides)):
            idx = np.arange(n, dtype=np.int64) * s
            out += idx.reshape([-1 if a == axis else 1 for a in range(self.ndim)])
        return out

    def offsets(self, flat: np.ndarray) -> np.ndarray:
        """Static memory offsets of the view's row-major elements ``flat`` (indices into
        the view, any shape)."""
        flat = np.asarray(flat, np.int64)
        idx = np.unravel_index(flat, self.shape) if self.ndim else ()
        out = np.full(flat.shape, self.offset.const, np.int64)
        for i, s in zip(idx, self.strides):
            out += i.astype(np.int64) * s
        return out

    def gather(self, flat: np.ndarray, params=None) -> np.ndarray:
        """The view's elements out of ``flat`` (the DRAM tensor, flattened)."""
        shift = self.offset.eval(params or {}) - self.offset.const
        return flat[self.element_offsets() + shift]


def _nocopy_strides(shape, strides, new_shape):
    """Strides of ``new_shape`` over the same memory, or None (numpy's
    ``_attempt_nocopy_reshape``, C order)."""
    old = [(int(n), int(s)) for n, s in zip(shape, strides) if n != 1]
    new_strides = [0] * len(new_shape)
    if any(n == 0 for n in new_shape):
        return tuple(new_strides)
    oi, oj, ni, nj = 0, 1, 0, 1
    while ni < len(new_shape) and oi < len(old):
        np_, op = new_shape[ni], old[oi][0]
        while np_ != op:
            if np_ < op:
                np_ *= new_shape[nj]
                nj += 1
            else:
                op *= old[oj][0]
                oj += 1
        for ok in range(oi, oj - 1):
            if old[ok][1] != old[ok + 1][0] * old[ok + 1][1]:
                return None
        new_strides[nj - 1] = old[oj - 1][1]
        for nk in range(nj - 1, ni, -1):
            new_strides[nk - 1] = new_strides[nk] * new_shape[nk]
        ni, nj, oi, oj = nj, nj + 1, oj, oj + 1
    last = new_strides[ni - 1] if ni >= 1 else 1
    for nk in range(ni, len(new_shape)):            # trailing size-1 dimensions
        new_strides[nk] = last
    return tuple(new_strides)
