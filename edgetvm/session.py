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
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from edgetvm.errors import EdgeTVMError
from edgetvm.frontend import import_onnx
from edgetvm.relax_passes import AnnotateLLMSemantics, QuantizeW4A16
from edgetvm.relax_passes.quant_report import quantization_report
from edgetvm.target.emulator import Emulator
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules.attention import (ATTENTION_LOWERING, schedule_decode_attention,
                                             schedule_prefill_attention)
from edgetvm.tir_schedules.common import new_schedule
from edgetvm.tir_schedules.embedding import schedule_embedding
from edgetvm.tir_schedules.kv_cache import (KV_APPEND_LOWERING, KV_APPEND_PAGES_LOWERING,
                                            schedule_kv_append, schedule_kv_append_pages)
from edgetvm.tir_schedules.workloads import embedding as embedding_workload

from .kv_state import KVState, capacity_bucket
from .npu_regions import (KernelCache, build_cluster, keeps_heads, offloadable,
                          passthrough_outputs,
                          rows_of, unsound_offloads)
from .offload import offload_regions
from .region_ops import (activation_input, attention_roles, mask_scale, mask_terms,
                         param_index, past_input, result_dtypes, result_shapes, rope_dims,
                         rope_heads_axis, rope_roles, softcap)

log = logging.getLogger("edgetvm")
_SESSION_IDS = itertools.count()
HOST = tvm.target.Target({"kind": "llvm", "num-cores": 2})


@dataclass
class StepMeter:
    """What the NPU did during one model call. The kernels run one after the other on one
    emulator timeline, so time, energy and the windowed power (with throttling) are those
    of the whole step; bytes and per-kind cycles are sums over its kernels."""

    cycles: int = 0
    dram_read_bytes: int = 0
    dram_write_bytes: int = 0
    energy_uj: float = 0.0
    peak_power_mw: float = 0.0
    avg_power_mw: float = 0.0
    throttled_cycles: int = 0
    kernels: int = 0
    cycles_by_kind: Counter = field(default_factory=Counter)
    write_bytes_by_kind: Counter = field(default_factory=Counter)

    def add(self, kind: str, c) -> None:
        self.dram_read_bytes += c.dram_read_bytes
        self.dram_write_bytes += c.dram_write_bytes
        self.throttled_cycles += c.throttled_cycles
        self.kernels += 1
        self.cycles_by_kind[kind] += c.total_cycles
        self.write_bytes_by_kind[kind] += c.dram_write_bytes

    def close(self, timeline) -> "StepMeter":
        """Take the step's time, energy and power from its timeline."""
        t = timeline.counters()
        self.cycles, self.energy_uj = t["total_cycles"], t["energy_uj"]
        self.peak_power_mw, self.avg_power_mw = t["peak_power_mw"], t["avg_power_mw"]
        return self


class NPUSession:
    """Compile ``onnx_path`` for ``spec`` and run it with the NPU parts on the emulator.

    ``quantize``: None, a group size (``QuantizeW4A16(group_size=G)``: float zero points,
    fp16 scales) or a configured ``QuantizeW4A16`` pass; ``quant_report`` then says what
    the linears weigh (``relax_passes/quant_report.py``).
    """

    def __init__(self, onnx_path, spec="edge-npu-16mb", profile=None, shape_overrides=None,
                 max_tokens: int = 1024, row_buckets=(16, 32, 64, 128, 256, 512, 1024),
                 quantize=None, kv_page_pool=None):
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        t0 = time.time()
        self.imported = import_onnx(onnx_path, shape_overrides=shape_overrides)
        log.info("imported %s (%d ops) in %.1fs", onnx_path, sum(self.imported.op_histogram.values()),
                 time.time() - t0)
        mod = self.imported.mod
        self.quant_report = None
        if quantize:
            # fp32/fp16 linears -> W4A16: a group size (float zero points, fp16 scales) or
            # a configured QuantizeW4A16 pass
            qpass = QuantizeW4A16(group_size=quantize) if isinstance(quantize, int) else quantize
            mod = qpass(mod)
            self.quant_report = quantization_report(mod)
            log.info("quantized linears to W4A16:\n%s", self.quant_report.summary())
        mod = AnnotateLLMSemantics()(mod)
        prefix = f"edgetvm.npu.s{next(_SESSION_IDS)}"
        mod, self.regions = offload_regions(mod, offloadable, prefix, prune=unsound_offloads)
        log.info("offloaded %d regions to the NPU: %s", len(self.regions),
                 dict(Counter(r.kind for r in self.regions)))
        self._error = None
        for r in self.regions:
            tvm_ffi.register_global_func(r.symbol, self._keep_error(self._region_fn(r)),
                                         override=True)
        t0 = time.time()
        mod = relax.transform.DecomposeOpsForInference()(mod)
        self.vm = relax.VirtualMachine(tvm.compile(mod, HOST), tvm.cpu())
        log.info("host code compiled in %.1fs", time.time() - t0)
        self.emu = Emulator(self.spec, profile)
        self.timeline = self.emu.timeline()
        self.kernels = KernelCache(self.spec)
        self._programs: dict = {}
        self._weights: dict = {}
        self.meter = StepMeter()
        self.row_buckets = tuple(sorted(row_buckets))
        self._max_tokens = max_tokens
        self._kv_page_pool = kv_page_pool
        self.kv = self._kv_state()
        self._pending_kv: dict = {}
        self._attention_calls = 0

    def _kv_state(self):
        kv_regions = [r for r in self.regions if r.kind == "kv_append"]
        if not kv_regions:
            return None
        shapes = [self.imported.mod["main"].params[i].ty.shape.values
                  for i, n in enumerate(self.imported.input_names) if "past_key_values" in n]
        kv_heads, head_dim = int(shapes[0][1]), int(shapes[0][3])
        layers = len({past_input(r)[0] for r in kv_regions})
        return self._new_kv_state(layers, kv_heads, head_dim)

    def _new_kv_state(self, layers: int, kv_heads: int, head_dim: int) -> KVState:
        return KVState(layers, kv_heads, head_dim, self._max_tokens,
                       page_pool=self._kv_page_pool)

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
        self.timeline = self.emu.timeline()
        self._attention_calls = 0
        mask = feeds.get("attention_mask")
        if mask is not None and not np.all(mask):
            raise EdgeTVMError("padded sequences (zeros in attention_mask) are not supported: "
                               "the NPU attention masks by length and causality only")
        # float inputs in the width the imported graph takes (its interface casts folded:
        # frontend/io_casts.py); the params are in the order of the inputs
        params = self.imported.mod["main"].params
        args = [tvm.runtime.tensor(np.ascontiguousarray(_as_param(feeds[n], p)))
                for n, p in zip(self.imported.input_names, params)]
        self._error = None
        try:
            out = self.vm["main"](*args)
        except Exception:
            if self._error is not None:      # a region refused: its error, not the VM's
                raise self._error from None
            raise
        outs = list(out) if isinstance(out, (tuple, list, tvm_ffi.Array)) else [out]
        # each output in the file's width (a float16 graph's casts to float32 folded)
        widths = self.imported.output_dtypes
        return {n: o.numpy().astype(widths[n]) if n in widths else o.numpy()
                for n, o in zip(self.imported.output_names, outs)}, \
            self.meter.close(self.timeline)

    def _keep_error(self, fn):
        """``fn`` that remembers the EdgeTVMError it raises: the VM hands the caller a
        RuntimeError with the callback's traceback instead."""
        def call(*args):
            try:
                return fn(*args)
            except EdgeTVMError as e:
                self._error = e
                raise
        return call

    def _region_fn(self, region):
        special = {"kv_append": self._kv_append_fn, "rope": self._rope_fn,
                   "attention": self._attention_fn,
                   "embedding": self._embedding_fn}.get(region.kind)
        if special is not None:
            return special(region)

        passthrough = passthrough_outputs(region.func)
        order = _kernel_input_order(region)
        dtypes = result_dtypes(region.func)

        def run(*tensors):
            # shape arguments of the region's glue reshapes are not data
            data = [t for t in tensors if hasattr(t, "numpy")]
            arrays = [data[i].numpy() for i in order(len(data))]
            shapes = result_shapes(region.func, region.runtime_positions, tensors)
            y = self._npu(region, arrays)
            if not passthrough:
                return tvm.runtime.tensor(y.reshape(shapes[0]).astype(dtypes[0]))
            x = arrays[0]
            outs = [x if p else y for p in passthrough]
            return tvm_ffi.convert([tvm.runtime.tensor(np.ascontiguousarray(
                o.reshape(shp).astype(dt))) for o, shp, dt in zip(outs, shapes, dtypes)])
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
        res = self.timeline.run(program, feeds)
        self.meter.add(region.kind, res.counters)
        return res.outputs["y"]

    def _rope_fn(self, region):
        """RoPE: the rotation runs on the NPU over (tokens, heads * rotary_dim) rows; the
        host passes the per-position cos/sin rows the graph computed (a table lookup on a
        device that stores the table), does the head transposes (glue) and, for partial
        rotary, puts back the dimensions that do not rotate."""
        roles = rope_roles(region.func)
        rotary = int(region.attrs["edgetvm.rotary_dim"])
        heads_major = rope_heads_axis(region) == 1
        (dtype,) = result_dtypes(region.func)

        def run(*args):
            given = dict(zip(region.runtime_positions, args))
            const = dict(enumerate(region.args))
            value = {k: (given[i].numpy() if i in given else const[i]) for k, i in roles.items()}
            (out_shape,) = result_shapes(region.func, region.runtime_positions, args)
            b, h, s, d = rope_dims(region, out_shape)
            x = value["x"]
            if x.ndim == 4 and heads_major:
                # a 4-D input is laid out as the output, (b, h, s, d) or (b, s, h, d); a
                # projection output (b, s, h * d) is 3-D
                x = x.transpose(0, 2, 1, 3)
            x = np.ascontiguousarray(x).reshape(b, s, h, d)
            cos, sin = (np.broadcast_to(np.asarray(value[k], np.float32).reshape(
                -1, s, rotary), (b, s, rotary)) for k in ("cos", "sin"))
            rows = b * s
            y = self._npu(region, [np.ascontiguousarray(x[..., :rotary]).reshape(rows, h * rotary),
                                   cos.reshape(rows, rotary), sin.reshape(rows, rotary)])
            y = y.reshape(b, s, h, rotary).astype(dtype)
            if rotary < d:
                y = np.concatenate([y, x[..., rotary:].astype(dtype)], axis=-1)
            if heads_major:
                y = y.transpose(0, 2, 1, 3)
            return tvm.runtime.tensor(np.ascontiguousarray(y))
        return run

    def _embedding_fn(self, region):
        """Embedding gather on the NPU: one DMA per token from the table, at a DRAM offset
        that is the token id (a runtime parameter), so one program serves every prompt of
        its length bucket."""
        table = next(v for v in region.args if v is not None and np.ndim(v) == 2)
        vocab, hidden = table.shape
        (dtype,) = result_dtypes(region.func)

        def run(*args):
            # token ids (batch, seq), or positions of any shape (XGLM's are flat)
            ids = next(a.numpy() for a in args if hasattr(a, "numpy") and a.dtype.startswith(
                "int"))
            flat = ids.reshape(-1)
            flat = np.where(flat < 0, flat + vocab, flat)        # ONNX Gather: negative wraps
            rows = flat.size
            c = self.bucket(rows)
            key = ("embedding", region.index, c)
            program = self._programs.get(key)
            if program is None:
                sch = new_schedule(embedding_workload(c, vocab, hidden))
                schedule_embedding(sch, tile_m=min(c, 16), slots_out=2, dma_split=1)
                e16 = self._weights.setdefault(region.index, {"E": table.astype(np.float16)})
                program = self._programs[key] = lower_primfunc(
                    sch.mod["main"], self.spec, "embedding", consts=e16, runtime=["ids"])
            params = {f"ids.{i}": int(flat[i]) if i < rows else 0 for i in range(c)}
            res = self.timeline.run(program, {}, params=params)
            self.meter.add("embedding", res.counters)
            out = res.outputs["out"][:rows].reshape(*ids.shape, hidden).astype(dtype)
            return tvm.runtime.tensor(out)
        return run

    def _kv_append_fn(self, region):
        """KV append: the new tokens' K/V go into the layer's paged cache on the device (the
        append kernel writes only them; attention reads the pages). The region's value is
        the ``present`` of the ONNX graph, a graph output a caller may read: it is returned
        with its data, the given past followed by the new tokens."""
        layer, which, past_at = past_input(region)

        def run(*args):
            past = args[past_at].numpy()
            new = next(a for i, a in enumerate(args) if i != past_at and hasattr(a, "numpy"))
            b, hk, pos, d = past.shape
            new = _heads_major(new.numpy(), hk, d)
            if new.ndim != 4 or new.shape[1] != hk or new.shape[3] != d or new.shape[0] != b:
                raise EdgeTVMError(f"KV append region {region.index}: new tokens of shape "
                                   f"{new.shape} do not match the cache {past.shape}")
            pend = self._pending_kv.setdefault(layer, {})
            pend[which] = (new, past)
            if len(pend) == 2:
                self._append(layer, pend.pop("key"), pend.pop("value"), pos)
            return tvm.runtime.tensor(np.concatenate([past, new.astype(past.dtype)], axis=2))
        return run

    def _append(self, layer: int, k_in, v_in, pos: int) -> None:
        kv = self.kv
        (k, k_past), (v, v_past) = k_in, v_in
        s = k.shape[2]
        c = self.bucket(s)
        if pos == 0 and layer == 0:
            kv.reset()
        kv.reserve(pos, c)
        if kv.layer_len.get(layer, 0) != pos or not self._past_on_device(layer, k_past, pos):
            # the caller brought its own past (a fixed-shape decode export, or another
            # sequence's): upload it into this layer's pages; later steps append on device
            self._upload_past(layer, k_past, v_past)
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
        res = self.timeline.run(program, feeds, params=params)
        self.meter.add("kv_append", res.counters)
        kv.layer_len[layer] = pos + s
        kv.length = pos + s

    def _past_on_device(self, layer: int, k_past, pos: int) -> bool:
        """Does the device hold this past? Its last token's keys are compared (fp16, as
        stored); a caller that switched sequences at the same length is caught here."""
        if pos == 0:
            return True
        kv = self.kv
        state = self.emu.state.get(kv.names(layer)["K_cache"])
        if state is None:
            return False
        t = pos - 1
        stored = state[kv.page_table[t // kv.page_tokens], :, t % kv.page_tokens]
        return bool(np.array_equal(stored, k_past[0, :, t].astype(np.float16)))

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
        flash-style, with the queries at ``pos``. The layer is that of the KV-append region
        producing K (in an export without past: the attention calls in order).

        The kernel masks by causality and length; a region that adds a mask is checked to
        add exactly that (0 where a key is visible, -inf-like elsewhere), so a model with
        an additive position bias (ALiBi) or padding is refused, not answered wrongly."""
        scale = float(region.attrs.get("edgetvm.scale", "nan"))
        cap = softcap(region)
        roles = attention_roles(region.func)
        hq, d = int(region.attrs["edgetvm.num_heads"]), int(region.attrs["edgetvm.head_dim"])
        heads_major_out = keeps_heads(region)
        (dtype,) = result_dtypes(region.func)
        k_source = region.arg_sources[roles["k"]]
        layer_of_k = past_input(k_source)[0] if getattr(k_source, "kind", None) == \
            "kv_append" else None

        def run(*args):
            given = dict(zip(region.runtime_positions, args))
            q = _heads_major(given[roles["q"]].numpy(), hq, d)
            b, _, s, _ = q.shape
            layer = layer_of_k
            if layer is None:
                # an export without past: this call's K/V are the whole sequence; they go
                # into the pages like any append, then attention reads the pages
                layer = self._attention_calls
                self._attention_calls += 1
                hk = int(region.attrs["edgetvm.num_kv_heads"])
                k, v = (_heads_major(given[roles[r]].numpy(), hk, d) for r in ("k", "v"))
                if self.kv is None:
                    layers = sum(r.kind == "attention" for r in self.regions)
                    self.kv = self._new_kv_state(layers, hk, d)
                empty = np.zeros(k.shape[:2] + (0, d), np.float32)
                self._append(layer, (k, empty), (v, empty), 0)
            kv = self.kv
            pos = kv.layer_len[layer] - s
            sc = scale if scale == scale else d ** -0.5
            slopes = window = None
            if "mask" in roles:
                mask = given[roles["mask"]].numpy() if roles["mask"] in given else \
                    region.args[roles["mask"]]
                slopes, window = _mask_slopes(mask * mask_scale(region), pos, s,
                                              region.index, hq)
            if slopes is not None and cap is not None:
                raise EdgeTVMError(
                    f"attention region {region.index}: soft-capped scores with ALiBi's bias: "
                    f"the NPU attention kernel does not take both")
            out = self._attend(layer, q[0].transpose(1, 0, 2), pos, sc,
                               None if slopes is None else slopes / sc, softcap=cap,
                               window=window)
            if heads_major_out:              # (s, hq, d) -> (hq, s, d): Falcon's layout
                out = out.transpose(1, 0, 2)
            (shape,) = result_shapes(region.func, region.runtime_positions, args)
            return tvm.runtime.tensor(np.ascontiguousarray(out.reshape(shape).astype(dtype)))
        return run

    def _attend(self, layer: int, q, pos: int, scale: float, slopes=None,
                softcap=None, window=None) -> np.ndarray:
        """q (s, hq, d) at positions pos.. -> (s, hq, d); ``slopes`` (hq,): ALiBi's, in
        unscaled-score units (the model's over the softmax scale); ``softcap``: the scores
        are ``softcap * tanh(scale * q @ k^T)``; ``window``: keys that many or more
        positions behind the query hidden."""
        kv = self.kv
        s, hq, d = q.shape
        valid = pos + s
        pages = capacity_bucket(-(-valid // kv.page_tokens))
        tile = min(64, pages * kv.page_tokens)
        alibi = slopes is not None
        if s == 1:
            # the scale is an immediate of the program: a key per scale (GPT-2 scales each
            # layer's scores by its index; one program for all gave every layer the first's)
            key = ("decode_attention", pages, alibi, scale, softcap, window)
            build = lambda: schedule_decode_attention(  # noqa: E731
                kv.layout, hq, pages, self.spec, tile_kv=tile, slots_kv=2, slots_s=1,
                scale=scale, alibi=alibi, softcap=softcap, window=window)
            feeds = {"q": q[0].astype(np.float16)}
            params = {"valid_len": valid}
        else:
            c = self.bucket(s)
            key = ("prefill_attention", c, pages, alibi, scale, softcap, window)
            build = lambda: schedule_prefill_attention(  # noqa: E731
                kv.layout, hq, c, self.spec, tile_q=min(64, c), tile_kv=tile, slots_kv=2,
                slots_s=1, chunked=True, max_pages=pages, scale=scale, alibi=alibi,
                softcap=softcap, window=window)
            qp = np.zeros((c, hq, d), np.float16)
            qp[:s] = q
            feeds = {"q": qp}
            params = {"valid_len": valid, "pos": pos}
        if alibi:
            feeds["slopes"] = np.asarray(slopes, np.float32).reshape(hq, 1)
        base = self._programs.get(key)
        if base is None:
            base = lower_primfunc(build().mod["main"], self.spec, key[0], outputs=["out"],
                                  **ATTENTION_LOWERING)
            self._programs[key] = base
        program = self._layer_program(key, base, layer)
        params.update(kv.layout.page_table_params(kv.page_table, pages))
        res = self.timeline.run(program, feeds, params=params)
        self.meter.add("attention", res.counters)
        return res.outputs["out"][:s] if s > 1 else res.outputs["out"][None]


def _kernel_input_order(region):
    """``order(n)``: positions of the region's n runtime tensors in the order of the kernel's
    inputs (a gated activation: the activation's input first, then the multiplier)."""
    first = 0
    if region.kind == "activation" and region.attrs.get("edgetvm.gated") == "1":
        gate = param_index(region.func, activation_input(region))
        tensors = [p for p in region.runtime_positions
                   if isinstance(region.func.params[p].ty, relax.TensorType)]
        first = tensors.index(gate)
    return lambda n: [first] + [i for i in range(n) if i != first]


def _mask_slopes(mask, pos: int, s: int, index: int, heads: int):
    """``(slopes, window)`` of the additive ``mask`` (..., s, pos + s) of queries at
    ``pos..pos + s - 1``: ``(None, None)`` when it is the causal mask; ALiBi's slope per
    head (``heads``) when it is that plus ALiBi's bias; the sliding window ``w`` when it
    hides keys ``w`` or more positions behind the query too; else raise (see
    :func:`~edgetvm.region_ops.mask_terms`)."""
    try:
        return mask_terms(mask, pos, s, heads)
    except ValueError as e:
        raise EdgeTVMError(f"attention region {index}: {e}") from None


def _heads_major(x, kv_heads: int, head_dim: int):
    """K/V as (b, kv_heads, s, head_dim): a projection output (b, s, heads * d) gets the
    reshape and head transpose the region does; a (b, s, heads, d) one (an export that
    dropped the transpose, which is the identity when s == 1) the transpose, and a
    (b, s, a, c, d) one (heads in groups, ``a * c = kv_heads``) the merge and transpose."""
    if x.ndim == 5:
        b, s = x.shape[:2]
        return x.reshape(b, s, kv_heads, head_dim).transpose(0, 2, 1, 3)
    if x.ndim == 3:
        b, s, n = x.shape
        return x.reshape(b, s, n // head_dim, head_dim).transpose(0, 2, 1, 3)
    if x.ndim == 4 and x.shape[1] != kv_heads and x.shape[2] == kv_heads:
        return x.transpose(0, 2, 1, 3)
    return x


def _as_param(array, param) -> np.ndarray:
    """``array`` in ``param``'s float dtype where both are float, else unchanged."""
    array = np.asarray(array)
    dtype = str(getattr(param.ty, "dtype", ""))
    if array.dtype.kind == "f" and dtype.startswith("float") and array.dtype.name != dtype:
        return array.astype(dtype)
    return array
