"""Fusion strategies measured on whole phase programs: the source study's Table 4.

For SmolLM2-135M on ``edge-npu-16mb``, each fusion strategy's partition is compiled into
one static program per case and run on the emulator under each power profile:

* scope ``model``: the whole forward pass (the program ``edgetvm.build`` ships);
* scope ``layer``: one decoder layer's ops (those from layer 0's attention up to layer
  1's: attention, O projection, MLP, and the next layer's norm, QKV and RoPE, which store
  the new K and V into its pages), linked and run alone;

at prefill 128, prefill 512 (from position 0) and decode at KV 1024 (1,024 cached tokens,
1 new). Per row: DRAM bytes, latency, energy, peak windowed power, throttled cycles, the
number of clusters (kernels), and latency relative to ``op-library`` in the same case; a
model decode row also gives its latency against the bandwidth roofline (the bytes a step
must move: every weight, one embedding row, the KV read and the new K/V written), a model
prefill row against the compute roofline (the MACs a step must do at the matrix unit's
peak: every linear on the rows it computes, the last layer after its attention and the
logits on the last position only, and causal attention, each query against the keys up
to its own position, in the last layer the last query only) and against the
bound its measured energy sets under the profile's budget (:func:`energy_bound`).
Every strategy uses the same default (untuned) knobs per kernel; ``edgellm`` chooses its
cut points from emulator measurements of candidate clusters (edgetvm/build/search.py).

Numerics: every model-scope run's logits are compared with onnxruntime on the same ONNX
file (prefill: a random prompt; decode: a random token after 1,024 random tokens, whose
K/V onnxruntime computes and the emulator's KV pages are loaded with); a row outside
tolerance fails the run. Every strategy sees the same inputs.

    python benchmarks/strategies.py [--quick] [--json PATH] [--model PATH]
        [--strategies a,b] [--profiles a,b] [--quantize G]

``--quick``: layer scope at prefill 128 and decode, model scope at decode, profile
``performance``. The model is ``--model``, else ``$EDGETVM_SMOLLM2`` or ``../smollm2``
(``../shared/tools/models/make_smollm2.sh`` builds it).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

from edgetvm.build.compiler import ModelCompiler
from edgetvm.generate import KVSpec, feeds_for, onnxruntime_runner
from edgetvm.kv_state import capacity_bucket
from edgetvm.relax_passes.partition import STRATEGIES
from edgetvm.run import DEFAULT_ATOL, DEFAULT_RTOL
from edgetvm.target.emulator import Emulator
from edgetvm.runtime.model import ModelInfo, ModelRunner
from report import numerics_exit_code, write_json

REPO = Path(__file__).resolve().parent.parent
#: (name, phase, rows, tokens in the cache before the step)
CASES = (("prefill 128", "prefill", 128, 0), ("prefill 512", "prefill", 512, 0),
         ("decode @1024", "decode", 1, 1024))
#: --cases names: scope/case
CASE_NAMES = {"p128": CASES[0], "p512": CASES[1], "d1024": CASES[2]}
MAX_TOKENS = 1040


def find_model() -> Path | None:
    for folder in (os.environ.get("EDGETVM_SMOLLM2"), REPO.parent / "smollm2"):
        if folder and (Path(folder) / "optimum_with_past/model.onnx").is_file():
            return Path(folder) / "optimum_with_past/model.onnx"
    return None


def layer_slice(graph):
    """Indices of one layer's ops: from layer 0's attention to layer 1's (the new K and V
    go straight into the pages, ``edgetvm/build/kv_pages.py``: no KV append kernel marks
    a layer's start)."""
    attentions = [i for i, op in enumerate(graph.ops) if op.kind == "attention"]
    if len(attentions) < 2:
        raise SystemExit("the model has fewer than two layers: no layer scope")
    return attentions[0], attentions[1]


def sub_graph(graph, lo: int, hi: int):
    """The ops ``lo:hi`` of ``graph`` as a graph of their own: what they compute for ops
    after them becomes an output of the program."""
    consumers = graph.consumers()
    tensors = dict(graph.tensors)
    for op in graph.ops[lo:hi]:
        for v in op.outputs.values():
            if any(c >= hi for c in consumers.get(v.tensor, ())):
                tensors[v.tensor] = dataclasses.replace(tensors[v.tensor], kind="output")
    return dataclasses.replace(graph, ops=graph.ops[lo:hi], tensors=tensors)


class Bench:
    def __init__(self, model: str, quantize, profiles):
        t0 = time.time()
        self.model = model
        self.mc = ModelCompiler(model, max_tokens=MAX_TOKENS, max_rows=512, quantize=quantize,
                                strategy="regions")
        print(f"front end: {time.time() - t0:.1f} s", flush=True)
        self.profiles = profiles
        self.kv = KVSpec.of(model)
        self.ort = onnxruntime_runner(model)
        self._inputs: dict = {}

    def info(self, graph) -> ModelInfo:
        return ModelInfo(graph.layers, graph.kv_heads, graph.head_dim, self.mc.page_tokens,
                         MAX_TOKENS, int(graph.tensors["logits"].shape[-1]))

    def programs(self, scope, phase, rows, pages, strategy, profile):
        """(program, clusters, build seconds, edgellm measurements)."""
        mc = self.mc
        t0 = time.time()
        g = mc.graph(phase, rows, pages)            # (first: it makes mc.kernels)
        before = mc.search(profile).measurements
        if scope == "model":
            # the whole program as a build links it (with a replayed log: the defaults
            # where it measured them faster, the prefetches placed as it measured them)
            program = mc.program(phase, rows, pages, strategy, keep=False, profile=profile)
            clusters = len(program.metadata["kernels"])
        else:
            g = sub_graph(g, *layer_slice(g))
            groups = mc.partition(g, strategy, profile)
            program = mc.link(g, groups, f"{scope}_{phase}_{rows}x{pages}p_{strategy}",
                              strategy=strategy)
            clusters = len(groups)
        return program, clusters, time.time() - t0, mc.search(profile).measurements - before

    def inputs(self, case, vocab):
        """(ids, past) of a case, the same for every strategy: random token ids, and for
        decode the KV of ``cached`` random tokens as onnxruntime computes it."""
        name, phase, rows, cached = case
        if name not in self._inputs:
            rng = np.random.default_rng(len(self._inputs))
            ids = [int(i) for i in rng.integers(0, vocab, size=rows)]
            past = None
            if cached:
                prompt = [int(i) for i in rng.integers(0, vocab, size=cached)]
                outs, _ = self.ort(feeds_for(self.kv, prompt, 0, None))
                past = {n: outs[n] for names in self.kv.names for n in names[2:]}
            self._inputs[name] = (ids, past)
        return self._inputs[name]

    def run(self, scope, case, strategy, profile, *, trace=False, spec=None) -> dict:
        """One case's row; the program and the emulator's result (with its trace when
        ``trace``) are kept as :attr:`last_run`. ``spec``: run on this spec instead of
        the compiler's (the same programs on another device model)."""
        name, phase, rows, cached = case
        pages = capacity_bucket(-(-(cached + rows) // self.mc.page_tokens))
        program, clusters, build_s, measured = self.programs(scope, phase, rows, pages,
                                                             strategy, profile)
        g = self.mc.graph(phase, rows, pages)
        vocab = int(g.tensors["logits"].shape[-1])
        ids, past = self.inputs(case, vocab)
        key = (phase, rows, pages)
        # the runtime's page bookkeeping and parameters; the program runs on an emulator
        # of our own so that the cache can hold onnxruntime's past
        model = ModelRunner({key: program}, [key, ("prefill" if phase == "decode" else
                                                   "decode", 1, 1)], self.info(g), None)
        emu = Emulator(spec or self.mc.spec, profile)
        if cached:
            model.kv.reserve(0, cached)
            self.upload(emu, model.kv, past)
        params = model.params_for(program, key, ids, cached)
        t0 = time.time()
        res = emu.run(program, {}, params, trace=trace)
        self.last_run = (program, res)
        c = res.counters
        row = dict(scope=scope, case=name, strategy=strategy, profile=profile,
                   clusters=clusters, build_s=round(build_s, 2), edgellm_measurements=measured,
                   run_s=round(time.time() - t0, 2))
        if scope == "model":
            logits = np.asarray(res.outputs["logits"], np.float32).reshape(-1, vocab)[-1]
            row.update(self.check(ids, cached, past, logits))
        if scope == "model" and phase == "decode":
            row["bandwidth_roofline_ratio"] = c.total_cycles / self.decode_roofline(
                program, g, cached)
        if scope == "model" and phase == "prefill":
            roof = self.compute_roofline(g, cached)
            row["compute_roofline_ratio"] = c.total_cycles / roof
            row["energy_bound_roofline_ratio"] = energy_bound(spec or self.mc.spec, c,
                                                              profile) / roof
        row.update(dram_bytes=int(c.dram_read_bytes + c.dram_write_bytes),
                   cycles=int(c.total_cycles), latency_us=float(c.time_us),
                   energy_uj=float(c.energy_uj), peak_power_mw=float(c.peak_power_mw),
                   throttled_cycles=int(c.throttled_cycles), launches=int(c.launches))
        return row

    def decode_roofline(self, program, graph, cached) -> float:
        """Cycles to move the bytes a decode step must move, over the DRAM bandwidth:
        every weight (of the embedding table one row), the KV cache read and the new
        token's K/V written."""
        emb = [op.inputs["E"].tensor for op in graph.ops if op.kind == "embedding"]
        must = 0
        for t in program.tensors.values():
            if t.kind != "const" or t.name.startswith("table."):
                continue
            must += t.nbytes // t.shape[0] if t.name in emb else t.nbytes
        kv = graph.layers * 2 * graph.kv_heads * graph.head_dim * 2
        must += kv * (cached + 1) + kv
        return must / self.mc.spec.dram_bytes_per_cycle

    def compute_roofline(self, graph, cached) -> float:
        """Cycles to do the MACs a step must do at the matrix unit's peak: each linear's
        rows x N x K as the graph computes it (prefill: the last layer after its attention,
        the lm_head included, on the last position only), and attention's QK^T and PV
        over the keys each query sees (causal: query ``i`` of a prompt at position
        ``cached`` sees ``cached + i + 1`` keys); of the last layer's attention only the
        last query's, the one row its consumers read (its K and V are the cache's, so
        the projections still count every row)."""
        spec = self.mc.spec
        cycles = 0.0
        attns = [i for i, op in enumerate(graph.ops) if op.kind == "attention"]
        for i, op in enumerate(graph.ops):
            if op.kind == "stage" and op.stage.op.startswith("linear"):
                (out,) = op.outputs.values()
                rows, n = int(np.prod(out.shape[:-1])), int(out.shape[-1])
                k = int(op.inputs[op.stage.inputs[0]].shape[-1])   # the activation
                rate = spec.mma_macs_per_cycle[
                    "w4a16" if op.stage.op == "linear_w4a16" else "fp16"]
                cycles += rows * n * k / rate
            elif op.kind == "attention":
                rows = graph.rows
                keys = rows * cached + rows * (rows + 1) // 2
                if op.attrs.get("last_row") or (i == attns[-1] and
                                                _last_row_only(graph.ops[i + 1:])):
                    keys = cached + rows                         # the last query's alone
                cycles += (2 * keys * op.attrs["q_heads"] * op.attrs["head_dim"]
                           / spec.mma_macs_per_cycle["fp16"])
        return cycles

    def upload(self, emu, kv, past) -> None:
        """Host -> device copy of onnxruntime's past into the pages (set-up, not measured):
        layer N's pages hold ``present.N.key`` / ``.value``."""
        for k_in, v_in, k_out, v_out in self.kv.names:
            layer = int(re.search(r"\.(\d+)\.", k_in).group(1))
            names = kv.names(layer)
            for state, src in ((names["K_cache"], k_out), (names["V_cache"], v_out)):
                pages = np.zeros(kv.layout.shape, np.float16)
                arr = past[src][0]                       # (heads, tokens, head_dim)
                for t in range(arr.shape[1]):
                    pages[kv.page_table[t // kv.page_tokens], :, t % kv.page_tokens] = arr[:, t]
                emu.state[state] = pages

    def check(self, ids, cached, past, logits) -> dict:
        outs, _ = self.ort(feeds_for(self.kv, ids, cached, past))
        ref = np.asarray(outs["logits"][0, -1], np.float32)
        diff = float(np.abs(logits - ref).max())
        tol = DEFAULT_ATOL + DEFAULT_RTOL * float(np.abs(ref).max())
        return dict(max_abs_diff=diff, tolerance=tol, numerics_ok=diff <= tol,
                    same_argmax=int(np.argmax(logits)) == int(np.argmax(ref)))


def _last_row_only(ops) -> bool:
    """Do these ops (those after the last attention) all compute one row?"""
    outs = [t for op in ops for t in op.outputs.values()]
    return bool(outs) and all(int(np.prod(t.shape[:-1])) == 1 for t in outs)


def energy_bound(spec, counters, profile: str) -> float:
    """Cycles a run's measured energy above static power takes at the profile's budget
    above static power: a run that spends that energy and keeps its average power within
    the budget (as it does when every window is) takes at least that long; a run faster
    than its bound drew more than the budget on average (the governor does not slow
    DRAM). A bound on this schedule's energy, not on the step: a schedule that moves fewer
    bytes or pads fewer MACs spends less (and with ``dvfs_exponent`` > 1, a lower clock
    spends less per MAC)."""
    static_uj = spec.power_static_mw * counters.time_us / 1000.0
    budget_mw = spec.profile(profile).budget_mw - spec.power_static_mw
    return (counters.energy_uj - static_uj) / budget_mw * 1000.0 * spec.clock_mhz  # uJ/mW = ms


def roofline_summary(row, kind: str) -> str:
    """A row against its ``kind`` (bandwidth or compute) roofline, and a prefill row's
    energy bound against the same roofline."""
    text = f"{row[f'{kind}_roofline_ratio']:.3f}x the {kind} roofline"
    if "energy_bound_roofline_ratio" in row:
        text += (f"; its energy alone needs {row['energy_bound_roofline_ratio']:.3f}x at "
                 f"the {row['profile']} budget")
    return text


def print_table(rows) -> None:
    hdr = (f"{'scope':<6} {'case':<13} {'profile':<12} {'strategy':<11} {'clusters':>8} "
           f"{'DRAM MB':>8} {'latency us':>11} {'vs op-lib':>9} {'energy uJ':>10} "
           f"{'peak mW':>8} {'throttled':>9} {'numerics':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        num = "" if "numerics_ok" not in r else ("ok" if r["numerics_ok"] else "WRONG")
        ratio = f"{r['vs_op_library']:.3f}" if r.get("vs_op_library") else "-"
        print(f"{r['scope']:<6} {r['case']:<13} {r['profile']:<12} {r['strategy']:<11} "
              f"{r['clusters']:>8} {r['dram_bytes'] / 1e6:>8.2f} {r['latency_us']:>11.1f} "
              f"{ratio:>9} {r['energy_uj']:>10.1f} {r['peak_power_mw']:>8.0f} "
              f"{r['throttled_cycles']:>9} {num:>9}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true",
                    help="layer scope at prefill 128 and decode, model decode, performance")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    ap.add_argument("--model", help="a text-generation-with-past ONNX export (default SmolLM2)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--profiles", default=None, help="default: performance,balanced")
    ap.add_argument("--cases", default=None, metavar="SCOPE/CASE,...",
                    help="e.g. layer/p512,model/d1024 (scopes layer, model; cases p128, "
                         "p512, d1024; default: all six)")
    ap.add_argument("--quantize", type=int, default=None, metavar="G",
                    help="W4A16 with group G (default: fp16 weights)")
    args = ap.parse_args(argv)
    model = args.model or find_model()
    if model is None:
        print("SmolLM2 not found: pass --model, set $EDGETVM_SMOLLM2, or build it with "
              "../shared/tools/models/make_smollm2.sh", file=sys.stderr)
        return 2
    strategies = args.strategies.split(",")
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        ap.error(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    if "op-library" not in strategies:
        strategies.insert(0, "op-library")
    profiles = (args.profiles or ("performance" if args.quick else "performance,balanced"))
    profiles = profiles.split(",")
    if args.cases:
        plan = []
        for item in args.cases.split(","):
            scope, _, case = item.partition("/")
            if scope not in ("layer", "model") or case not in CASE_NAMES:
                ap.error(f"--cases: {item!r} is not SCOPE/CASE (layer|model / "
                         f"{'|'.join(CASE_NAMES)})")
            plan.append((scope, CASE_NAMES[case]))
    elif args.quick:
        plan = [("layer", CASES[0]), ("layer", CASES[2]), ("model", CASES[2])]
    else:
        plan = [(s, c) for s in ("layer", "model") for c in CASES]
    bench = Bench(str(model), args.quantize, profiles)
    for p in profiles:
        bench.mc.spec.profile(p)                  # unknown profiles fail before any work
    rows = []
    for scope, case in plan:
        for profile in profiles:
            base = None
            for strategy in strategies:
                r = bench.run(scope, case, strategy, profile)
                base = r["cycles"] if strategy == "op-library" else base
                r["vs_op_library"] = r["cycles"] / base
                rows.append(r)
                print(f"  {scope} {case[0]} {profile} {strategy}: {r['cycles']} cycles, "
                      f"{r['clusters']} clusters (build {r['build_s']} s, run {r['run_s']} s)",
                      flush=True)
    print()
    print_table(rows)
    for r in rows:
        for kind in ("bandwidth", "compute"):
            if f"{kind}_roofline_ratio" in r:
                print(f"{r['case']} {r['profile']} {r['strategy']}: "
                      f"{roofline_summary(r, kind)}")
    if args.json:
        write_json(args.json, {"benchmark": "strategies", "model": str(model),
                               "target": bench.mc.spec.name, "quantize": args.quantize,
                               "rows": rows})
    return numerics_exit_code(rows, ("scope", "case", "profile", "strategy"))


if __name__ == "__main__":
    sys.exit(main())
