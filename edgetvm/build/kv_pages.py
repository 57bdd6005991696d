"""The KV append as addressing: a layer's new keys and values stored straight into the pages.

A layer's new K (after RoPE) and V are computed by a kernel: a projection, a RoPE, a
cluster holding both, a fused QKV projection whose output they are columns of. The paged
cache (``tir_schedules/kv_cache.py``) keeps each KV head's ``page_tokens x head_dim``
block of a page contiguous, so token-major rows are not its layout: an append kernel of
its own loaded the new tokens back from the activation arena and stored them into the
pages, a DRAM round trip of the new K and V and a launch per layer (SmolLM2's prefill
512: 31 k cycles a layer, 2.3 % of the step, with every unit but the DMA channels idle).

:func:`fold_kv_appends` drops those append ops: the producing kernel's stores of the new
K and V values are relocated onto the cache through the page table instead
(:func:`relocate_paged`). A store window's values of one token and KV head are one run of
``head_dim`` (or fewer) contiguous values; the same run of the next tokens of one page is
one DMA at the page block's row stride. The tensor's other values (a fused projection's
Q columns) keep their arena slot and their strided relocation. The pages are runtime
parameters, as the append kernel's are:

* ``pages`` (a prefill chunk of whole pages, which runs at a page boundary): token ``t``
  of the chunk goes to page ``dst_page.<t // page_tokens>``, row ``t % page_tokens``; a
  run of a page's tokens is one DMA;
* ``slots`` (a decode step, a chunk that is not whole pages: ``--chunk`` builds): token
  ``t`` goes to page ``slot_page.<t>``, row ``slot_offset.<t>``, one DMA per token and
  head as the append kernel's; in a chunk of more than one token each is predicated on
  ``n_new > t``: a partly filled last chunk stores its real tokens only (the slots of its
  padding rows are the last real token's).

An append keeps its kernel when its new K or V values are read by another op too, are
written by a host op, or do not lie one token per row of their tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from edgetvm.target.isa import Affine, DmaLoad, DramRef, TcmRef, as_affine
from edgetvm.tir_schedules.kv_cache import KVCacheLayout

from .graph import BuildError, PhaseGraph
from .views import View

#: the graph tensor kind of an activation whose every value is new K or V: its producers
#: store it into the pages only (no arena slot)
KV_PAGES = "kv_pages"


@dataclass(frozen=True)
class PageTarget:
    """Values of a tensor that go into a layer's cache ``state`` (a program state tensor
    of ``layout.shape``): ``view`` is the append's ``(rows, kv_heads, 1, head_dim)`` view
    of the tensor (which value is token ``t``'s head ``h``'s ``j``-th), ``mode`` the
    runtime parameters that address the pages (``pages`` or ``slots``)."""

    state: str
    layout: KVCacheLayout
    mode: str
    view: View


@dataclass(frozen=True)
class Paging:
    """How a tensor with new K/V values (``tokens`` rows of them) is relocated: per column
    of its ``width``-value rows, the index of the :class:`PageTarget` it goes to (-1: the
    arena), its KV head and its place in the head."""

    targets: tuple
    tokens: int                  # rows of the step
    width: int
    target_of: np.ndarray
    head_of: np.ndarray
    j_of: np.ndarray


def append_mode(graph: PhaseGraph, layout: KVCacheLayout) -> str:
    """How ``graph``'s new K/V are addressed in the pages, by their producers or by an
    append kernel (``KernelBuilder._kv_append``): ``pages`` (whole pages of a prefill
    chunk at a page boundary) or ``slots`` (one slot per token)."""
    if graph.phase == "prefill" and graph.rows % layout.page_tokens == 0:
        return "pages"
    return "slots"


def fold_kv_appends(graph: PhaseGraph, layout: KVCacheLayout) -> int:
    """Drop the KV append ops whose new K and V their producers can store into the pages
    themselves (module doc); returns how many were dropped. A tensor all of whose values
    go to the pages becomes a ``kv_pages`` tensor; every such tensor gets a ``pages``
    :class:`Paging`."""
    mode = append_mode(graph, layout)
    consumers, producers = graph.consumers(), graph.producers()
    targets: dict = {}                 # tensor -> [PageTarget]
    dropped = set()
    for i, op in enumerate(graph.ops):
        if op.kind != "kv_append":
            continue
        found = [(op.inputs[role], PageTarget(f"L{op.layer}.{cache}", layout, mode,
                                              op.inputs[role]))
                 for role, cache in (("k_new", "K_cache"), ("v_new", "V_cache"))]
        if all(_foldable(graph, v, i, consumers, producers, layout) for v, _ in found) and \
                not _overlap(*(v for v, _ in found)):
            dropped.add(i)
            for v, target in found:
                targets.setdefault(v.tensor, []).append(target)
    graph.ops[:] = [op for i, op in enumerate(graph.ops) if i not in dropped]
    for name, ts in targets.items():
        t = graph.tensors[name]
        t.pages = _paging(t, graph.rows, ts, layout)
        if np.all(t.pages.target_of >= 0):
            t.kind = KV_PAGES
    return len(dropped)


def _foldable(graph, view: View, index: int, consumers, producers, layout) -> bool:
    """Can the producers of ``view`` (an append op's ``(rows, kv_heads, 1, head_dim)``
    input) store it into the pages: an activation written by NPU kernels, one token per
    row of its tensor, none of its values read by another op?"""
    t = graph.tensors[view.tensor]
    rows = graph.rows
    if t.kind != "activation" or view.offset.terms or t.size % rows or \
            view.shape != (rows, layout.kv_heads, 1, layout.head_dim) or \
            not producers.get(view.tensor) or \
            any(graph.ops[p].kind == "host" for p in producers[view.tensor]):
        return False
    width = t.size // rows
    elems = view.element_offsets().reshape(rows, -1)
    if np.any(elems // width != np.arange(rows)[:, None]) or \
            np.any(elems % width != elems[:1] % width):
        return False                   # not one token per row, in the same columns
    for c in consumers.get(view.tensor, ()):
        if c != index and any(v.tensor == view.tensor and _overlap(v, view)
                              for v in graph.ops[c].inputs.values()):
            return False
    return True


def _overlap(a: View, b: View) -> bool:
    return a.tensor == b.tensor and bool(np.isin(a.element_offsets(),
                                                 b.element_offsets()).any())


def _paging(t, rows: int, targets: list, layout: KVCacheLayout) -> Paging:
    width = t.size // rows
    target_of = np.full(width, -1, np.int64)
    head_of = np.zeros(width, np.int64)
    j_of = np.zeros(width, np.int64)
    hk, d = layout.kv_heads, layout.head_dim
    for k, target in enumerate(targets):
        cols = target.view.element_offsets()[0].reshape(hk, d)     # token 0's columns
        target_of[cols] = k
        head_of[cols] = np.arange(hk)[:, None]
        j_of[cols] = np.arange(d)[None, :]
    return Paging(tuple(targets), rows, width, target_of, head_of, j_of)


def token_rows(cmd, width: int):
    """``cmd`` (a DMA of a kernel tensor whose rows are ``width`` values long) with a window
    that is contiguous on both sides and spans whole rows refolded into those rows: a
    lowering that stores a tile of whole rows as one long row would otherwise leave one
    DMA per token and head, where rows of one page and head are one strided DMA."""
    load = isinstance(cmd, DmaLoad)
    tcm, dram = (cmd.dst, cmd.src) if load else (cmd.src, cmd.dst)
    rows, cols = dram.shape
    off = as_affine(dram.offset)
    if cols == width or off.terms or cmd.valid_rows is not None or \
            (rows * cols) % width or off.const % width or \
            (rows > 1 and (dram.row_stride != cols or tcm.stride != cols)):
        return cmd
    n = rows * cols // width
    tcm = TcmRef(tcm.offset, (n, width), tcm.dtype, width)
    dram = DramRef(dram.tensor, (n, width), width, dram.offset)
    return replace(cmd, dst=tcm, src=dram) if load else replace(cmd, src=tcm, dst=dram)


def relocate_paged(ref: DramRef, view: View, paging: Paging, arena=None) -> list:
    """The DMA windows a kernel's window ``ref`` (of a kernel tensor bound to ``view`` of a
    tensor with new K/V values, relocated by ``paging``) covers: ``[(DramRef, row0, rows,
    col0, cols)]`` as :func:`~edgetvm.build.link.relocate_window` gives them. Each row of
    ``ref`` is cut into runs of contiguous values of one token and KV head (or of the
    tensor's other values, relocated by ``arena(window)``, ``relocate_window`` onto the
    tensor's arena slot); a run and the same run of the next rows are one DMA while their
    tokens follow one another in one page (``slots``: one token, predicated on
    ``n_new`` where the step has more than one: a sixth field, the piece's ``when``)."""
    if as_affine(ref.offset).terms or view.offset.terms:
        raise BuildError(f"a window at a runtime offset into the new K/V of "
                         f"{paging.targets[0].state}")
    pt = paging.targets[0].layout.page_tokens
    rows, cols = ref.shape
    base = as_affine(ref.offset).const
    local = base + np.arange(rows, dtype=np.int64)[:, None] * ref.row_stride + \
        np.arange(cols, dtype=np.int64)[None, :]
    elem = view.offsets(local)                     # offsets into the tensor
    token, col = elem // paging.width, elem % paging.width
    which, head, j = paging.target_of[col], paging.head_of[col], paging.j_of[col]
    # a run ends where the values stop being contiguous or change target or KV head
    brk = (np.diff(elem, axis=1) != 1) | (np.diff(which, axis=1) != 0) | \
        ((np.diff(head, axis=1) != 0) & (which[:, 1:] >= 0))
    runs = []
    for r in range(rows):
        cuts = np.flatnonzero(brk[r]) + 1
        starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [cols]))
        runs.append(tuple((int(a), int(b - a), int(which[r, a])) for a, b in zip(starts, ends)))
    pieces = []
    g0 = 0
    while g0 < rows:                               # rows whose runs are alike
        g1 = g0 + 1
        while g1 < rows and runs[g1] == runs[g0]:
            g1 += 1
        for c0, n, k in runs[g0]:
            if k < 0:
                if arena is None:
                    raise BuildError(f"a window of the new K/V of {paging.targets[0].state} "
                                     f"covers values that are not")
                sub = DramRef(ref.tensor, (g1 - g0, n), ref.row_stride,
                              base + g0 * ref.row_stride + c0)
                pieces += [(w, g0 + r0, m, c0 + d0, e, None) for w, r0, m, d0, e in arena(sub)]
                continue
            target = paging.targets[k]
            r0 = g0
            while r0 < g1:                         # tokens that follow in one page
                r1 = r0 + 1
                while target.mode == "pages" and r1 < g1 and \
                        token[r1, c0] == token[r1 - 1, c0] + 1 and \
                        col[r1, c0] == col[r0, c0] and \
                        token[r1, c0] // pt == token[r0, c0] // pt:
                    r1 += 1
                t0 = int(token[r0, c0])
                window = _cache_window(target, t0, int(head[r0, c0]), int(j[r0, c0]),
                                       r1 - r0, n)
                when = Affine.param("n_new", 1, -t0) if target.mode == "slots" and \
                    paging.tokens > 1 else None
                pieces.append((window, r0, r1 - r0, c0, n, when))
                r0 = r1
        g0 = g1
    return pieces


def _cache_window(target: PageTarget, token: int, head: int, j: int, rows: int,
                  cols: int) -> DramRef:
    """``rows`` tokens from ``token`` (of one page), values ``j .. j + cols`` of KV head
    ``head``, in the cache: the page (``slots``: and the row) a runtime parameter."""
    lay = target.layout
    d, pt = lay.head_dim, lay.page_tokens
    page = lay.kv_heads * pt * d
    if target.mode == "pages":
        offset = Affine.param(f"dst_page.{token // pt}", page, token % pt * d)
    else:
        offset = Affine(0, ((f"slot_page.{token}", page), (f"slot_offset.{token}", d)))
    offset = offset + head * pt * d + j
    return DramRef(target.state, (rows, cols), d if rows > 1 else cols, offset)
