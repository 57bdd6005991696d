"""NPUSession: one ONNX LLM compiled for the NPU, executed on the emulator.

The pipeline, top to bottom (each step logs its progress):

1. front end: ``import_onnx`` (symbolic lengths, W4A16 linears);
2. LLM semantics: ``AnnotateLLMSemantics`` groups attention, RoPE, norms, linears, MLP, KV
   append, embedding, lm_head, residual adds into regions;
3. offload: regions with an NPU kernel become calls into the NPU (``offload.py``);
4. host code: everything else (shape glue and regions without an NPU kernel) is compiled
   for the host CPU with ``tvm.compile`` and runs on the Relax VM;
5. at run time each offloaded region lowers its kernel once per shape (untuned default
   schedules, ``npu_regions.py``) and runs it on the emulator, whose counters are the
   latency, DRAM traffic and energy reported.
"""
from __future__ import annotations

import itertools
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir

from edgetvm.errors import EdgeTVMError
from edgetvm.frontend import import_onnx
from edgetvm.relax_passes import AnnotateLLMSemantics, QuantizeW4A16
from edgetvm.target.emulator import Emulator
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules.attention import (ATTENTION_LOWERING, schedule_decode_attention,
                                             schedule_prefill_attention)
from edgetvm.tir_schedules.embedding import schedule_embedding
from edgetvm.tir_schedules.kv_cache import (KV_APPEND_LOWERING, KV_APPEND_PAGES_LOWERING,
                                            schedule_kv_append, schedule_kv_append_pages)
from edgetvm.tir_schedules.workloads import embedding as embedding_workload

from .kv_state import KVState, capacity_bucket
from .npu_regions import (KernelCache, build_cluster, offloadable, passthrough_outputs,
                          rows_of)
from .offload import offload_regions

log = logging.getLogger("edgetvm")
_SESSION_IDS = itertools.count()
HOST = tvm.target.Target({"kind": "llvm", "num-cores": 2})


@dataclass
class StepMeter:
    """What the NPU did during one model call: sums over the kernels it ran."""

    cycles: int = 0
    dram_read_bytes: int = 0
    dram_write_bytes: int = 0
    energy_uj: float = 0.0
    kernels: int = 0
    cycles_by_kind: Counter = field(default_factory=Counter)
    write_bytes_by_kind: Counter = field(default_factory=Counter)

    def add(self, kind: str, c) -> None:
        self.cycles += c.total_cycles
        self.dram_read_bytes += c.dram_read_bytes
        self.dram_write_bytes += c.dram_write_bytes
        self.energy_uj += c.energy_uj
        self.kernels += 1
        self.cycles_by_kind[kind] += c.total_cycles
        self.write_bytes_by_kind[kind] += c.dram_write_bytes


class NPUSession:
    """Compile ``onnx_path`` for ``spec`` and run it with the NPU parts on the emulator."""

    def __init__(self, onnx_path, spec="edge-npu-16mb", profile=None, shape_overrides=None,
                 max_tokens: int = 1024, row_buckets=(16, 32, 64, 128, 256, 512, 1024),
                 quantize: int | None = None):
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        t0 = time.time()
        self.imported = import_onnx(onnx_path, shape_overrides=shape_overrides)
        log.info("imported %s (%d ops) in %.1fs", onnx_path, sum(self.imported.op_histogram.values()),
                 time.time() - t0)
        mod = self.imported.mod
        if quantize:
            # fp32/fp16 linears -> W4A16 with group ``quantize`` (symmetric, fp16 scales)
            mod = QuantizeW4A16(group_size=quantize)(mod)
            log.info("quantized linears to W4A16 (group %d)", quantize)
        mod = AnnotateLLMSemantics()(mod)
        prefix = f"edgetvm.npu.s{next(_SESSION_IDS)}"
        mod, self.regions = offload_regions(mod, offloadable, prefix)
        log.info("offloaded %d regions to the NPU: %s", len(self.regions),
                 dict(Counter(r.kind for r in self.regions)))
        for r in self.regions:
            tvm_ffi.register_global_func(r.symbol, self._region_fn(r), override=True)
        t0 = time.time()
        mod = relax.transform.DecomposeOpsForInference()(mod)
        self.vm = relax.VirtualMachine(tvm.compile(mod, HOST), tvm.cpu())
        log.info("host code compiled in %.1fs", time.time() - t0)
        self.emu = Emulator(self.spec, profile)
        self.kernels = KernelCache(self.spec)
        self._programs: dict = {}
        self._weights: dict = {}
        self.meter = StepMeter()
        self.row_buckets = tuple(sorted(row_buckets))
        self._max_tokens = max_tokens
        self.kv = self._kv_state(max_tokens)
        self._pending_kv: dict = {}
        self._attention_calls = 0

    def _kv_state(self, max_tokens: int):
        kv_regions = [r for r in self.regions if r.kind == "kv_append"]
        if not kv_regions:
            return None
        shapes = [self.imported.mod["main"].params[i].ty.shape.values
                  for i, n in enumerate(self.imported.input_names) if "past_key_values" in n]
        kv_heads, head_dim = int(shapes[0][1]), int(shapes[0][3])
        layers = len({_past_input(r)[0] for r in kv_regions})
        return KVState(layers, kv_heads, head_dim, max_tokens)

    def bucket(self, rows: int) -> int:
        """The row count NPU programs are compiled for: decode rows stay 1, prefill rows
        round up to a length bucket (one static program serves the whole bucket)."""
        if rows <= 1:
            return rows
        for b in self.row_buckets:
            if rows <= b:
                return b
        return rows

    def reset(self) -> None:
        """Forget the sequence (a new prompt): the KV pages are free again."""
        if self.kv is not None:
            self.kv.reset()

    # -- running the model --------------------------------------------------------------
    def __call__(self, feeds: dict):
        """Run the model once; ``feeds`` maps ONNX input names to arrays. Returns the ONNX
        outputs (name -> np.ndarray) and the step's :class:`StepMeter`."""
        self.meter = StepMeter()
        self._attention_calls = 0
        mask = feeds.get("attention_mask")
        if mask is not None and not np.all(mask):
            raise EdgeTVMError("padded sequences (zeros in attention_mask) are not supported: "
                               "the NPU attention masks by length and causality only")
        args = [tvm.runtime.tensor(np.ascontiguousarray(feeds[n])) for n in
                self.imported.input_names]
        out = self.vm["main"](*args)
        outs = list(out) if isinstance(out, (tuple, list, tvm_ffi.Array)) else [out]
        return {n: o.numpy() for n, o in zip(self.imported.output_names, outs)}, self.meter

    def _region_fn(self, region):
        special = {"kv_append": self._kv_append_fn, "rope": self._rope_fn,
                   "attention": self._attention_fn,
                   "embedding": self._embedding_fn}.get(region.kind)
        if special is not None:
            return special(region)

        passthrough = passthrough_outputs(region.func)

        def run(*tensors):
            # shape arguments of the region's glue reshapes are not data
            arrays = [t.numpy() for t in tensors if hasattr(t, "numpy")]
            y = self._npu(region, arrays)
            y = y.reshape(arrays[0].shape[:-1] + (y.shape[-1],)).astype(np.float32)
            if not passthrough:
                return tvm.runtime.tensor(y)
            x = arrays[0]
            outs = [x.reshape(-1, x.shape[-1]) if p else y for p in passthrough]
            return tvm_ffi.convert([tvm.runtime.tensor(np.ascontiguousarray(o)) for o in outs])
        return run

    def _npu(self, region, arrays) -> np.ndarray:
        """Run the region's NPU kernel on 2-D fp16 views of ``arrays``; returns ``y``.

        Rows are padded to the length bucket, so prefill lengths share programs."""
        rows = rows_of(arrays[0].shape)
        pad = self.bucket(rows) - rows
        arrays = [a.reshape(rows, -1) for a in arrays]
        if pad:
            arrays = [np.concatenate([a, np.zeros((pad, a.shape[1]), a.dtype)]) for a in arrays]
        return self._npu_exact(region, arrays)[:rows]

    def _npu_exact(self, region, arrays) -> np.ndarray:
        shapes = [a.shape for a in arrays]
        key = (region.index, tuple(shapes))
        entry = self._programs.get(key)
        if entry is None:
            cluster, consts, matmuls, m = build_cluster(region, shapes)
            # one weight pack per region, shared by the programs of every length bucket
            consts = self._weights.setdefault(region.index, consts)
            program = self.kernels.build(cluster, consts, matmuls, m)
            names = [n for n in cluster.tensors if n not in cluster.consts][:len(arrays)]
            entry = self._programs[key] = (program, names)
        program, names = entry
        feeds = {}
        for n, a in zip(names, arrays):
            want = program.tensors[n].shape
            a = a.reshape(want[0], -1)
            if a.shape[1] < want[1]:         # W4A16 K padded to whole quantization groups
                a = np.concatenate([a, np.zeros((a.shape[0], want[1] - a.shape[1]), a.dtype)],
                                   axis=1)
            feeds[n] = a.astype(np.float16)
        res = self.emu.run(program, feeds)
        self.meter.add(region.kind, res.counters)
        return res.outputs["y"]

    def _rope_fn(self, region):
        """RoPE: the rotation runs on the NPU; the host builds the per-position cos/sin rows
        (``computes_cos_sin`` regions: cos/sin of position * inv_freq, a table lookup on a
        device that stores the table) and does the head transpose (glue).

        The region's arguments differ between exports (symbolic or folded shapes, cos/sin
        computed or given), so they are told apart by rank and dtype."""
        computes = region.attrs.get("edgetvm.computes_cos_sin") == "1"

        def run(*args):
            runtime = [v.numpy() for v in args if hasattr(v, "numpy")]
            shape4 = next((tuple(int(x) for x in v) for v in args
                           if not hasattr(v, "numpy") and len(v) == 4), None)
            consts = [v for v in region.args if isinstance(v, np.ndarray)]
            arrays = runtime + consts
            # the projection output: (b, s, heads * d), or (b * s, heads * d) after a
            # quantized linear's reshape
            x = next(v for v in runtime if v.dtype.kind == "f" and v.ndim in (2, 3))
            if computes:
                pos_ids = next(v for v in runtime if v.dtype.kind in "iu")
                inv = next(v for v in consts if v.dtype.kind == "f" and v.size > 1)
                scal = [float(v) for v in consts if v.ndim == 0 and v.dtype.kind == "f"]
                c_mul, s_mul = scal if len(scal) == 2 else (1.0, 1.0)
                f = pos_ids.astype(np.float32)[:, :, None] * inv.reshape(1, 1, -1)
                emb = np.concatenate([f, f], axis=-1)
                cos = (np.cos(emb) * c_mul).astype(np.float32)
                sin = (np.sin(emb) * s_mul).astype(np.float32)
            else:
                cos4, sin4 = [v for v in arrays if v.ndim == 4][:2]
                cos, sin = cos4[:, 0], sin4[:, 0]
            d = cos.shape[-1]
            if shape4 is not None:
                b, s, h, _ = shape4
            else:
                b, s, h = x.shape[0], x.shape[1], x.shape[-1] // d
            cos = np.broadcast_to(cos, (b, s, d))
            sin = np.broadcast_to(sin, (b, s, d))
            rows = b * s
            y = self._npu(region, [x.reshape(rows, h * d), cos.reshape(rows, d),
                                   sin.reshape(rows, d)])
            out = y.reshape(b, s, h, d).transpose(0, 2, 1, 3).astype(np.float32)
            out = tvm.runtime.tensor(np.ascontiguousarray(out))
            if computes:
                return tvm_ffi.convert([tvm.runtime.tensor(np.ascontiguousarray(cos[:, None])),
                                        tvm.runtime.tensor(np.ascontiguousarray(sin[:, None])),
                                        out])
            return out
        return run

    def _embedding_fn(self, region):
        """Embedding gather on the NPU: one DMA per token from the table, at a DRAM offset
        that is the token id (a runtime parameter), so one program serves every prompt of
        its length bucket."""
        table = next(v for v in region.args if v is not None and np.ndim(v) == 2)
        vocab, hidden = table.shape

        def run(*args):
            ids = next(a.numpy() for a in args if hasattr(a, "numpy") and a.dtype.startswith(
                "int") and len(a.shape) == 2)
            b, s = ids.shape
            flat = ids.reshape(-1)
            flat = np.where(flat < 0, flat + vocab, flat)        # ONNX Gather: negative wraps
            rows = b * s
            c = self.bucket(rows)
            key = ("embedding", region.index, c)
            program = self._programs.get(key)
            if program is None:
                sch = s_tir.Schedule(tvm.IRModule({"main": embedding_workload(c, vocab,
                                                                               hidden)}))
                schedule_embedding(sch, tile_m=min(c, 16), slots_out=2, dma_split=1)
                e16 = self._weights.setdefault(region.index, {"E": table.astype(np.float16)})
                program = self._programs[key] = lower_primfunc(
                    sch.mod["main"], self.spec, "embedding", consts=e16, runtime=["ids"])
            params = {f"ids.{i}": int(flat[i]) if i < rows else 0 for i in range(c)}
            res = self.emu.run(program, {}, params=params)
            self.meter.add("embedding", res.counters)
            out = res.outputs["out"][:rows].reshape(b, s, hidden).astype(np.float32)
            return tvm.runtime.tensor(out)
        return run

    def _kv_append_fn(self, region):
        """KV append: the new tokens' K/V go into the layer's paged cache on the device (the
        append kernel writes only them). The region's value, the concatenated ``present``
        of the ONNX graph, is only a graph output now (attention reads the pages): it is
        returned with its shape and no data."""
        layer, which, past_at = _past_input(region)

        def run(*args):
            past_shape = tuple(args[past_at].shape)
            new = next(a for i, a in enumerate(args) if i != past_at and hasattr(a, "numpy"))
            new = new.numpy()
            b, hk, _, d = past_shape
            new = _heads_major(new, d)
            if new.ndim != 4 or new.shape[1] != hk or new.shape[3] != d:
                raise EdgeTVMError(f"KV append region {region.index}: new tokens of shape "
                                   f"{new.shape} do not match the cache {past_shape}")
            s = new.shape[2]
            pos = past_shape[-2]
            pend = self._pending_kv.setdefault(layer, {})
            pend[which] = (new, args[past_at])
            if len(pend) == 2:
                self._append(layer, pend.pop("key"), pend.pop("value"), pos)
            present = past_shape[:-2] + (pos + s, d)
            return tvm.runtime.tensor(np.zeros(present, np.float32))
        return run

    def _append(self, layer: int, k_in, v_in, pos: int) -> None:
        kv = self.kv
        (k, k_past), (v, v_past) = k_in, v_in
        s = k.shape[2]
        c = self.bucket(s)
        if pos == 0 and layer == 0:
            kv.reset()
        kv.reserve(pos, c)
        if kv.layer_len.get(layer, 0) != pos:
            # the caller brought its own past (e.g. a fixed-shape decode export): upload it
            # into this layer's pages once; steps after that append on the device
            self._upload_past(layer, k_past.numpy(), v_past.numpy())
        feeds = {}
        for name, x in (("k_new", k), ("v_new", v)):
            rows = np.zeros((c, kv.kv_heads, 1, kv.head_dim), np.float16)
            rows[:s] = x[0].transpose(1, 0, 2)[:, :, None, :]
            feeds[name] = rows
        if s > 1 and pos % kv.page_tokens == 0 and c % kv.page_tokens == 0:
            # prefill from a page boundary: whole pages, one DMA per (page, head)
            n = c // kv.page_tokens
            key = ("kv_append_pages", n)
            build = lambda: lower_primfunc(  # noqa: E731
                schedule_kv_append_pages(kv.layout, n, self.spec).mod["main"], self.spec,
                f"kv_append_pages_{n}", **KV_APPEND_PAGES_LOWERING)
            first = pos // kv.page_tokens
            params = {f"dst_page.{i}": kv.page_table[first + i] for i in range(n)}
        else:
            key = ("kv_append", c)
            build = lambda: lower_primfunc(  # noqa: E731
                schedule_kv_append(kv.layout, c, self.spec).mod["main"], self.spec,
                f"kv_append_{c}", **KV_APPEND_LOWERING)
            params = kv.layout.slot_params(kv.page_table, pos, c, s)
        base = self._programs.get(key)
        if base is None:
            base = self._programs[key] = build()
        program = self._layer_program(key, base, layer)
        res = self.emu.run(program, feeds, params=params)
        self.meter.add("kv_append", res.counters)
        kv.layer_len[layer] = pos + s
        kv.length = pos + s

    def _upload_past(self, layer: int, k_past, v_past) -> None:
        """Host -> device copy of a given past into the layer's pages (not NPU traffic)."""
        kv = self.kv
        for name, past in (("K_cache", k_past), ("V_cache", v_past)):
            state = self.emu.state.get(kv.names(layer)[name])
            if state is None or state.shape != kv.layout.shape:
                state = self.emu.state[kv.names(layer)[name]] = np.zeros(kv.layout.shape,
                                                                         np.float16)
            for t in range(past.shape[2]):
                state[kv.page_table[t // kv.page_tokens], :, t % kv.page_tokens] = past[0, :, t]

    def _layer_program(self, key, base, layer: int):
        lk = key + ("layer", layer)
        p = self._programs.get(lk)
        if p is None:
            p = self._programs[lk] = base.renamed(self.kv.names(layer))
        return p

    def _attention_fn(self, region):
        """Attention on the NPU over the paged KV cache: decode reads the pages through the
        page table up to the valid length; prefill (and chunked prefill) is causal,
        flash-style, with the queries at ``pos``. Layers are the attention calls in order."""
        scale = float(region.attrs.get("edgetvm.scale", "nan"))
        roles = attention_roles(region.func)

        def run(*args):
            layer = self._attention_calls
            self._attention_calls += 1
            given = dict(zip(region.runtime_positions, args))
            q = given[roles["q"]].numpy()
            b, hq, s, d = q.shape
            if region.arg_sources[roles["k"]] != "kv_append":
                # an export without past: this call's K/V are the whole sequence; they go
                # into the pages like any append, then attention reads the pages
                k, v = (_heads_major(given[roles[r]].numpy(), d) for r in ("k", "v"))
                if self.kv is None:
                    layers = sum(r.kind == "attention" for r in self.regions)
                    self.kv = KVState(layers, k.shape[1], d, self._max_tokens)
                empty = tvm.runtime.tensor(np.zeros(k.shape[:2] + (0, d), np.float32))
                self._append(layer, (k, empty), (v, empty), 0)
            kv = self.kv
            out = self._attend(layer, q[0].transpose(1, 0, 2), kv.length - s,
                               scale if scale == scale else d ** -0.5)
            return tvm.runtime.tensor(np.ascontiguousarray(
                out.reshape(b, s, hq * d).astype(np.float32)))
        return run

    def _attend(self, layer: int, q, pos: int, scale: float) -> np.ndarray:
        """q (s, hq, d) at positions pos.. -> (s, hq, d)."""
        kv = self.kv
        s, hq, d = q.shape
        valid = pos + s
        pages = capacity_bucket(-(-valid // kv.page_tokens))
        tile = min(64, pages * kv.page_tokens)
        if s == 1:
            key = ("decode_attention", pages)
            build = lambda: schedule_decode_attention(  # noqa: E731
                kv.layout, hq, pages, self.spec, tile_kv=tile, slots_kv=2, slots_s=1,
                scale=scale)
            feeds = {"q": q[0].astype(np.float16)}
            params = {"valid_len": valid}
        else:
            c = self.bucket(s)
            key = ("prefill_attention", c, pages)
            build = lambda: schedule_prefill_attention(  # noqa: E731
                kv.layout, hq, c, self.spec, tile_q=min(64, c), tile_kv=tile, slots_kv=2,
                slots_s=1, chunked=True, max_pages=pages, scale=scale)
            qp = np.zeros((c, hq, d), np.float16)
            qp[:s] = q
            feeds = {"q": qp}
            params = {"valid_len": valid, "pos": pos}
        base = self._programs.get(key)
        if base is None:
            base = lower_primfunc(build().mod["main"], self.spec, key[0], outputs=["out"],
                                  **ATTENTION_LOWERING)
            self._programs[key] = base
        program = self._layer_program(key, base, layer)
        params.update(kv.layout.page_table_params(kv.page_table, pages))
        res = self.emu.run(program, feeds, params=params)
        self.meter.add("attention", res.counters)
        return res.outputs["out"][:s] if s > 1 else res.outputs["out"][None]


def _heads_major(x, head_dim: int):
    """K/V as (b, kv_heads, s, head_dim): a projection output (b, s, heads * d) gets the
    reshape and head transpose the region does (constant folding drops the transpose in
    s == 1 exports, where it is the identity)."""
    if x.ndim == 3:
        b, s, n = x.shape
        return x.reshape(b, s, n // head_dim, head_dim).transpose(0, 2, 1, 3)
    return x


_PASS_THROUGH = {"relax.reshape", "relax.permute_dims", "relax.expand_dims",
                 "relax.broadcast_to", "relax.multiply", "relax.astype"}


def attention_roles(func) -> dict:
    """Which parameters of an attention region are q, k and v: trace the operands of its
    two matmuls (``q @ k^T``, then ``p @ v``) back through layout ops and scalings."""
    params = {p: i for i, p in enumerate(func.params)}
    defs = {}
    matmuls = []
    for block in func.body.blocks:
        for b in block.bindings:
            defs[b.var] = b.value
            if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == \
                    "relax.matmul":
                matmuls.append(b.value)

    def tensor_arg(v):
        # the operand that carries the data (not a scalar scale, not a shape)
        for a in v.args:
            if isinstance(a, relax.Var) and getattr(a.ty, "ndim", 0) >= 2:
                return a
        raise EdgeTVMError("attention region: cannot trace its q/k/v inputs")

    def source(e):
        while e not in params:
            v = defs.get(e)
            if not isinstance(v, relax.Call) or getattr(v.op, "name", "") not in _PASS_THROUGH:
                raise EdgeTVMError("attention region: cannot trace its q/k/v inputs")
            e = tensor_arg(v)
        return params[e]
    if len(matmuls) != 2:
        raise EdgeTVMError(f"attention region with {len(matmuls)} matmuls (expected 2)")
    return {"q": source(matmuls[0].args[0]), "k": source(matmuls[0].args[1]),
            "v": source(matmuls[1].args[1])}


def _past_input(region) -> tuple:
    """(layer, "key" | "value", runtime arg position) of a KV-append region's past input
    (``past_key_values_<n>_key`` at the call site)."""
    for k, pos in enumerate(region.runtime_positions):
        m = re.fullmatch(r"past_key_values_(\d+)_(key|value)", region.arg_names[pos] or "")
        if m:
            return int(m.group(1)), m.group(2), k
    raise EdgeTVMError(f"KV append region {region.index} does not read a past_key_values input")


