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

from edgetvm.frontend import import_onnx
from edgetvm.relax_passes import AnnotateLLMSemantics
from edgetvm.target.emulator import Emulator
from edgetvm.target.spec import load_spec

from .npu_regions import KernelCache, build_cluster, offloadable
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

    def add(self, kind: str, c) -> None:
        self.cycles += c.total_cycles
        self.dram_read_bytes += c.dram_read_bytes
        self.dram_write_bytes += c.dram_write_bytes
        self.energy_uj += c.energy_uj
        self.kernels += 1
        self.cycles_by_kind[kind] += c.total_cycles


class NPUSession:
    """Compile ``onnx_path`` for ``spec`` and run it with the NPU parts on the emulator."""

    def __init__(self, onnx_path, spec="edge-npu-16mb", profile=None, shape_overrides=None):
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        t0 = time.time()
        self.imported = import_onnx(onnx_path, shape_overrides=shape_overrides)
        log.info("imported %s (%d ops) in %.1fs", onnx_path, sum(self.imported.op_histogram.values()),
                 time.time() - t0)
        mod = AnnotateLLMSemantics()(self.imported.mod)
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
        self.meter = StepMeter()

    # -- running the model --------------------------------------------------------------
    def __call__(self, feeds: dict):
        """Run the model once; ``feeds`` maps ONNX input names to arrays. Returns the ONNX
        outputs (name -> np.ndarray) and the step's :class:`StepMeter`."""
        self.meter = StepMeter()
        args = [tvm.runtime.tensor(np.ascontiguousarray(feeds[n])) for n in
                self.imported.input_names]
        out = self.vm["main"](*args)
        outs = list(out) if isinstance(out, (tuple, list, tvm_ffi.Array)) else [out]
        return {n: o.numpy() for n, o in zip(self.imported.output_names, outs)}, self.meter

    def _region_fn(self, region):
        special = {"kv_append": self._kv_append_fn, "rope": self._rope_fn,
                   "attention": self._attention_fn}.get(region.kind)
        if special is not None:
            return special(region)

        def run(*tensors):
            arrays = [t.numpy() for t in tensors]
            y = self._npu(region, arrays)
            return tvm.runtime.tensor(y.reshape(arrays[0].shape[:-1] + (y.shape[-1],))
                                      .astype(np.float32))
        return run

    def _npu(self, region, arrays) -> np.ndarray:
        """Run the region's NPU kernel on 2-D fp16 views of ``arrays``; returns ``y``."""
        shapes = [a.shape for a in arrays]
        key = (region.index, tuple(shapes))
        entry = self._programs.get(key)
        if entry is None:
            cluster, consts, matmuls, m = build_cluster(region, shapes)
            program = self.kernels.build(cluster, consts, matmuls, m)
            names = [n for n in cluster.tensors if n not in cluster.consts][:len(arrays)]
            entry = self._programs[key] = (program, names)
        program, names = entry
        feeds = {n: a.reshape(program.tensors[n].shape).astype(np.float16)
                 for n, a in zip(names, arrays)}
        res = self.emu.run(program, feeds)
        self.meter.add(region.kind, res.counters)
        return res.outputs["y"]

    def _rope_fn(self, region):
        """RoPE: the rotation runs on the NPU; the host builds the per-position cos/sin rows
        (``computes_cos_sin`` regions: cos/sin of position * inv_freq, a table lookup on a
        device that stores the table) and does the head transpose (glue)."""
        a = region.args

        def run(*args):
            vals = [x.numpy() if hasattr(x, "numpy") else tuple(int(v) for v in x)
                    for x in args]
            full = list(a)
            for pos, v in zip(region.runtime_positions, vals):
                full[pos] = v
            if region.attrs.get("edgetvm.computes_cos_sin") == "1":
                inv_freq, _, pos_ids, c_mul, s_mul, x, shape = full
                f = pos_ids.astype(np.float32)[:, :, None] * inv_freq.reshape(1, 1, -1)
                emb = np.concatenate([f, f], axis=-1)
                cos = (np.cos(emb) * c_mul).astype(np.float32)
                sin = (np.sin(emb) * s_mul).astype(np.float32)
            else:
                x, shape, cos4, sin4 = full
                cos, sin = cos4[:, 0], sin4[:, 0]
            b, s, h, d = shape
            rows = b * s
            y = self._npu(region, [x.reshape(rows, h * d), cos.reshape(rows, d),
                                   sin.reshape(rows, d)])
            out = y.reshape(b, s, h, d).transpose(0, 2, 1, 3).astype(np.float32)
            out = tvm.runtime.tensor(np.ascontiguousarray(out))
            if region.attrs.get("edgetvm.computes_cos_sin") == "1":
                return tvm_ffi.convert([tvm.runtime.tensor(cos[:, None]),
                                        tvm.runtime.tensor(sin[:, None]), out])
            return out
        return run

    def _attention_fn(self, region):
        """Attention: HOST fallback for now (numpy, fp32), faithful to the region's graph:
        softmax((q * s1) @ (k * s2)^T + mask) @ v with grouped-query K/V repeat."""
        a = region.args

        def run(*args):
            vals = [x.numpy() if hasattr(x, "numpy") else tuple(int(v) for v in x)
                    for x in args]
            full = list(a)
            for pos, v in zip(region.runtime_positions, vals):
                full[pos] = v
            k, _, v, _, _, q, s1, s2, mask, nan_fill = full[:10]
            out_shape = full[11]
            group = q.shape[1] // k.shape[1]
            kk = np.repeat(k, group, axis=1)
            vv = np.repeat(v, group, axis=1)
            sc = (q * s1) @ np.swapaxes(kk * s2, -1, -2) + mask
            sc = sc - sc.max(axis=-1, keepdims=True)
            p = np.exp(sc)
            p = p / p.sum(axis=-1, keepdims=True)
            p = np.where(np.isnan(p), nan_fill, p)
            o = (p @ vv).transpose(0, 2, 1, 3).reshape(out_shape)
            return tvm.runtime.tensor(np.ascontiguousarray(o.astype(np.float32)))
        return run

    def _kv_append_fn(self, region):
        axis = -2

        def run(past, new):
            # TODO(kv-state): the paged KV cache kernel replaces this host concat
            return tvm.runtime.tensor(np.concatenate([past.numpy(), new.numpy()], axis=axis))
        return run
