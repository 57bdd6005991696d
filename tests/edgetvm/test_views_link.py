"""Glue as addressing: strided views (reshape, transpose, slice) against numpy, DMA windows
relocated through them against a brute-force element map, and the DRAM arena plan."""
import pathlib

import numpy as np
import pytest

from edgetvm.build.compiler import ModelCompiler
from edgetvm.build.link import plan_dram, relocate_window
from edgetvm.build.views import View
from edgetvm.relax_passes.partition import partition
from edgetvm.target.isa import Affine, DramRef

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def _random_view(rng, base_size=4096):
    """A random chain of glue ops on a contiguous tensor, and the same on numpy."""
    shape = tuple(int(x) for x in rng.integers(1, 6, rng.integers(1, 5)))
    v = View.whole("t", shape)
    a = np.arange(base_size)[:v.size].reshape(shape)
    for _ in range(4):
        op = rng.integers(0, 4)
        if op == 0:
            axes = rng.permutation(v.ndim)
            v, a = v.permute(axes), a.transpose(axes)
        elif op == 1:
            ax = int(rng.integers(0, v.ndim))
            b = int(rng.integers(0, v.shape[ax]))
            e = int(rng.integers(b + 1, v.shape[ax] + 1))
            st = int(rng.integers(1, 3))
            v, a = v.slice(ax, b, e, st), a[(slice(None),) * ax + (slice(b, e, st),)]
        elif op == 2:
            ax = int(rng.integers(0, v.ndim + 1))
            v, a = v.expand_dims([ax]), np.expand_dims(a, ax)
        else:
            dims = [int(d) for d in rng.permutation(_factors(v.size, rng))]
            w = v.reshape(dims)
            try:                                   # numpy without a copy, or not at all
                b = a.view()
                b.shape = dims
            except AttributeError:
                b = None
            assert (w is None) == (b is None), (v, dims)
            if w is not None:
                v, a = w, b
    return v, a


def _factors(n, rng):
    out = []
    while n > 1 and len(out) < 3:
        d = int(rng.choice([k for k in range(2, n + 1) if n % k == 0]))
        out.append(d)
        n //= d
    return out + ([n] if n > 1 or not out else [])


def test_views_address_what_numpy_does():
    rng = np.random.default_rng(0)
    base = np.arange(4096)
    for _ in range(1500):
        v, a = _random_view(rng)
        np.testing.assert_array_equal(v.gather(base), a)


def test_a_runtime_offset_shifts_every_element():
    v = View.whole("table", (10, 4)).slice(0, 0, 3).shifted(Affine.param("pos", 4))
    np.testing.assert_array_equal(v.gather(np.arange(80), {"pos": 5}),
                                  np.arange(80).reshape(20, 4)[5:8])


@pytest.mark.parametrize("seed", range(40))
def test_relocated_windows_move_exactly_the_mapped_elements(seed):
    rng = np.random.default_rng(seed)
    v, a = _random_view(rng)
    rows = int(a.shape[0]) if a.ndim > 1 else 1
    cols = a.size // rows
    kernel = a.reshape(rows, cols)               # the kernel's 2-D tensor, row-major
    r0 = int(rng.integers(0, rows))
    nr = int(rng.integers(1, rows - r0 + 1))
    c0 = int(rng.integers(0, cols))
    nc = int(rng.integers(1, cols - c0 + 1))
    ref = DramRef("k", (nr, nc), cols, r0 * cols + c0)
    base = 100
    pieces = relocate_window(ref, v, "arena", base)
    moved = np.full((nr, nc), -1, np.int64)
    for dram, pr, pn, pc, pm in pieces:
        assert dram.tensor == "arena" and dram.shape == (pn, pm)
        off = dram.offset
        targets = off + np.arange(pn)[:, None] * dram.row_stride + np.arange(pm)[None, :]
        assert np.all(moved[pr:pr + pn, pc:pc + pm] == -1), "a piece moved twice"
        moved[pr:pr + pn, pc:pc + pm] = targets - base
    np.testing.assert_array_equal(moved, kernel[r0:r0 + nr, c0:c0 + nc])


def test_the_arena_never_shares_bytes_between_live_tensors():
    mc = ModelCompiler(str(DATA / "gpt_neox_tiny_with_past.onnx"), max_tokens=64, max_rows=16)
    for strategy in ("op-library", "mega"):
        g = mc.graph("prefill", 16, 1)
        kernels = [mc.kernels.kernel(g, grp)
                   for grp in partition(g, strategy, fits=lambda grp: mc.fits(g, grp))]
        plan = plan_dram(g, kernels)
        names = list(plan.lifetimes)
        total = 0
        for i, x in enumerate(names):
            _, ox = plan.place[x]
            sx = g.tensors[x].size
            total += sx
            assert ox % 32 == 0                      # 64-byte (burst) aligned
            for y in names[i + 1:]:
                (a0, a1), (b0, b1) = plan.lifetimes[x], plan.lifetimes[y]
                if a1 < b0 or b1 < a0:
                    continue
                _, oy = plan.place[y]
                assert ox + sx <= oy or oy + g.tensors[y].size <= ox, (x, y)
        assert plan.arena_elems < total              # reuse happened


def test_a_host_op_reads_whole_tensors_copying_a_strided_view_first():
    # the host reads and writes whole DRAM tensors: a view of a tensor that is whole is
    # handed over as it is; a column slice (a fused projection's part) is first copied
    # into a tensor of its own by an NPU copy stage, reading exactly that window
    from edgetvm.build.graph import Tensor, _Extractor
    ex = _Extractor.__new__(_Extractor)
    ex.tensors = {"qkv": Tensor("qkv", (4, 96)), "y": Tensor("y", (4, 32))}
    ex.ops = []
    whole = View.whole("y", (4, 32)).reshape((1, 4, 32))
    assert ex._whole(whole, "h") is whole and not ex.ops
    part = View.whole("qkv", (4, 96)).slice(1, 32, 64).expand_dims([0])
    got = ex._whole(part, "h")
    (op,) = ex.ops
    assert op.kind == "stage" and op.stage.op == "copy"
    src = op.inputs["x"]
    assert src.tensor == "qkv" and src.shape == (4, 32) and src.strides == (96, 1)
    assert src.offset == Affine(32)
    assert got.shape == (1, 4, 32) and got.is_whole(ex.tensors[got.tensor].shape)
    assert got.tensor != "qkv"


def _copied(cmds) -> dict:
    """TCM byte offset -> DRAM element index of every element the loads copy, by the
    DramRef/TcmRef definitions (row-major windows, strides in elements / elements)."""
    from edgetvm.target.isa import ITEMSIZE
    got = {}
    for c in cmds:
        rows, cols = c.src.shape
        size = ITEMSIZE[c.dst.dtype]
        for r in range(rows):
            for k in range(cols):
                got[c.dst.offset + (r * c.dst.stride + k) * size] = \
                    c.src.offset + r * c.src.row_stride + k
    return got


@pytest.mark.parametrize("shape,stride,n", [((40, 24), 32, 6), ((1, 4096), 4096, 5),
                                            ((1, 100), 100, 8), ((3, 8), 8, 7)])
def test_a_prefetch_cut_into_blocks_copies_what_the_load_did(shape, stride, n):
    """The blocks a spread prefetch is queued in (``link._row_blocks``): together they copy
    exactly the load's elements to the same TCM bytes, one-row loads in whole 64-byte
    bursts, the first keeping the load's waits and the last its signals."""
    from edgetvm.build.link import _row_blocks
    from edgetvm.target.isa import DmaLoad, TcmRef
    load = DmaLoad(dst=TcmRef(1024, shape, "float16", shape[1]),
                   src=DramRef("w", shape, stride, 96), channel=1, wait=(3,), signal=(7,))
    blocks = _row_blocks(load, n)
    assert 1 < len(blocks) <= n
    assert _copied(blocks) == _copied([load])
    assert blocks[0].wait == (3,) and all(not b.wait for b in blocks[1:])
    assert blocks[-1].signal == (7,) and all(not b.signal for b in blocks[:-1])
    assert all(b.channel == 1 for b in blocks)
    if shape[0] == 1:
        assert all(b.src.shape[1] * 2 % 64 == 0 for b in blocks[:-1])
