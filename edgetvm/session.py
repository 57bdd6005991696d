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
        def run(*tensors):
            arrays = [t.numpy() for t in tensors]
            shapes = [a.shape for a in arrays]
            key = (region.index, tuple(shapes))
            entry = self._programs.get(key)
            if entry is None:
                cluster, consts, matmuls, m = build_cluster(region, shapes)
                program = self.kernels.build(cluster, consts, matmuls, m)
                entry = self._programs[key] = (program, list(cluster.tensors)[:len(arrays)])
            program, names = entry
            feeds = {n: a.reshape(program.tensors[n].shape).astype(np.float16)
                     for n, a in zip(names, arrays)}
            res = self.emu.run(program, feeds)
            self.meter.add(region.kind, res.counters)
            y = res.outputs["y"]
            out_shape = shapes[0][:-1] + (y.shape[-1],)
            return tvm.runtime.tensor(y.reshape(out_shape).astype(np.float32))
        return run
