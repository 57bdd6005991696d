"""``python -m edgetvm.tune model.onnx``: tune the kernel boundaries and the kernels of a
model's phase programs on the emulated NPU, appending every trial to a tuning log that
``python -m edgetvm.build model.onnx --log DIR`` replays."""
from __future__ import annotations

import argparse
import json
import os
import sys

from edgetvm.errors import EdgeTVMError

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "llama_tiny_with_past.onnx")


#: the share of a tune's budget the cut points may take (the rest tunes the kernels)
CUT_SHARE = 0.25


def select_keys(keys: list, phases) -> list:
    """The (phase, rows, pages) of ``keys`` named by ``phases`` (phase names, e.g.
    ``decode``, or program names, e.g. ``prefill_16x1p``)."""
    if not phases:
        return list(keys)
    names = {f"{p}_{r}x{g}p": (p, r, g) for p, r, g in keys}
    out = []
    for want in phases:
        hit = [k for k in keys if k[0] == want] or ([names[want]] if want in names else [])
        if not hit:
            raise EdgeTVMError(f"--phases: no program {want!r}; the build has "
                               f"{', '.join(sorted(names))}")
        out += [k for k in hit if k not in out]
    return out


def tune(onnx_path: str, *, target="edge-npu-16mb", profile=None, strategy="regions",
         buckets=None, chunk=None, quantize=None, max_tokens=None, phases=None,
         trials=None, time_budget=None, log_dir="tuning_logs", workers=1, rpc_tracker=None,
         rpc_key=None, timeout=300.0, seed=0, batch=8, use_model=True, cuts=True,
         cut_share=CUT_SHARE, validate=True, progress=True) -> dict:
    """Tune ``onnx_path``; returns the report (see :meth:`Tuner.report`).

    Two stages on one log and one budget: with ``cuts``, first the kernel boundaries of
    every run of fusable ops (partition tasks, :mod:`edgetvm.build.cuts`; the strategy's
    partition is their starting point), for at most ``cut_share`` of the budget; then the
    knobs of the kernels of the best partition found, for the rest.
    Candidates are measured in this process, on ``workers`` local emulator processes, or
    on the servers of the TVM RPC tracker ``rpc_tracker`` ("HOST:PORT") under
    ``rpc_key`` (``workers``: how many of them at once; default every free one).
    ``validate``: link every selected phase program with the default (the strategy's
    partition, default knobs) and with the replayed log, and measure both
    (``rep["phases"]``)."""
    import math
    import time

    from edgetvm.build.cli import DEFAULT_BUCKETS
    from edgetvm.build.compiler import ModelCompiler

    from .log import Replay, TuningLog, TuningLogError, log_context
    from .tasks import extract_partition_tasks, extract_tasks

    if not os.path.isfile(onnx_path):
        raise EdgeTVMError(f"{onnx_path}: no such file")
    if not 0 < cut_share < 1:
        raise EdgeTVMError(f"--cut-share: the share of the budget for cut points must be "
                           f"in (0, 1), not {cut_share}")
    asked = (chunk,) if chunk else tuple(sorted(set(buckets or DEFAULT_BUCKETS)))
    mc = ModelCompiler(onnx_path, target, quantize=quantize, max_tokens=max_tokens,
                       strategy=strategy, max_rows=max(asked), profile=profile)
    rows = tuple(b for b in asked if b <= mc.max_tokens)
    if not rows:
        raise EdgeTVMError(f"no prefill bucket fits a KV cache of {mc.max_tokens} tokens")
    keys = select_keys(mc.phase_keys(rows, chunked=bool(chunk)), phases)
    ctx = log_context(onnx_path, mc.spec, mc.profile, quantize)
    opts = dict(seed=seed, batch=batch, use_model=use_model, progress=progress)
    reps = []
    t_start = time.time()           # the budget: from here (after the front end)
    with TuningLog(log_dir) as tlog:
        if cuts:
            ptasks = extract_partition_tasks(mc, keys)
            if ptasks:
                share = dict(trials=None if trials is None else max(1, math.ceil(
                                 trials * cut_share)),
                             time_budget=None if time_budget is None else
                             time_budget * cut_share)
                reps.append(_stage(mc, ptasks, tlog, ctx, "cuts", share, opts, workers,
                                   rpc_tracker, rpc_key, timeout))
            try:
                mc.set_cuts(Replay(log_dir, ctx).cuts_for)
            except TuningLogError:
                pass                     # nothing measured: the strategy's partition
        tasks = extract_tasks(mc, keys)
        done = sum(r["measured"] for r in reps)
        left = dict(trials=None if trials is None else trials - done,
                    time_budget=None if time_budget is None else
                    time_budget - (time.time() - t_start))
        if (left["trials"] is None or left["trials"] > 0) and \
                (left["time_budget"] is None or left["time_budget"] > 0):
            reps.append(_stage(mc, tasks, tlog, ctx, "tiles", left, opts, workers,
                               rpc_tracker, rpc_key, timeout))
    rep = _merge(reps, time.time() - t_start)
    rep["programs"] = [f"{p}_{r}x{g}p" for p, r, g in keys]
    rep["context"] = ctx.as_dict()
    if validate:
        mc.set_cuts(None)                # the default: the strategy's partition
        replay = Replay(log_dir, ctx)
        tuned = ModelCompiler(onnx_path, target, quantize=quantize, max_tokens=max_tokens,
                              strategy=strategy, max_rows=max(asked), profile=profile,
                              **replay.compiler_options)
        rep["budget_mw"] = mc.spec.profile(mc.profile).budget_mw
        rep["phases"] = []
        for p, r, g in keys:
            a, b = program_counters(mc, (p, r, g)), program_counters(tuned, (p, r, g))
            rep["phases"].append(dict(
                program=f"{p}_{r}x{g}p", default_cycles=a.total_cycles,
                tuned_cycles=b.total_cycles, default_peak_mw=round(a.peak_power_mw, 1),
                tuned_peak_mw=round(b.peak_power_mw, 1),
                default_kernels=len(mc.program(p, r, g).metadata["kernels"]),
                tuned_kernels=len(tuned.program(p, r, g).metadata["kernels"])))
    return rep


def _stage(mc, tasks, tlog, ctx, name, budget, opts, workers, rpc_tracker, rpc_key,
           timeout) -> dict:
    """One tuner over ``tasks`` with ``budget`` (trials / time_budget)."""
    from .tuner import Tuner

    measurer = make_measurer(mc, tasks, ctx.profile, workers, rpc_tracker, rpc_key,
                             timeout)
    try:
        tuner = Tuner(mc, tasks, tlog, ctx, measurer=measurer, desc=name, **opts)
        return tuner.run(**budget)
    finally:
        measurer.close()


def _merge(reps: list, seconds: float) -> dict:
    """The report of the stages (cut points, then tiles) as one."""
    if not reps:
        return dict(tasks=[], measured=0, seconds=seconds, step_cycles_default=0,
                    step_cycles_tuned=0, stages=[])
    out = dict(reps[-1])
    out["tasks"] = [t for r in reps for t in r["tasks"]]
    out["measured"] = sum(r["measured"] for r in reps)
    out["seconds"] = seconds
    out["stages"] = [dict(stage=r["stage"], measured=r["measured"],
                          seconds=round(r["seconds"], 1),
                          step_cycles_default=r["step_cycles_default"],
                          step_cycles_tuned=r["step_cycles_tuned"]) for r in reps]
    return out


def program_counters(mc, key):
    """The measured Counters of the whole linked phase program ``key`` of compiler ``mc``
    (its kernels with cross-kernel prefetch, at the bucket's full KV capacity)."""
    from edgetvm.build.measure import measure_program
    from edgetvm.target.emulator import Emulator

    return measure_program(mc.program(*key), mc.graph(*key), mc.layout,
                           Emulator(mc.spec, mc.profile))


def make_measurer(mc, tasks, profile, workers=1, rpc_tracker=None, rpc_key=None,
                  timeout=300.0):
    """The measurer the options ask for (:mod:`edgetvm.tune.measure`)."""
    from .measure import ForkMeasurer, LocalMeasurer, RunnerMeasurer
    if rpc_tracker:
        from edgetvm.rpc_protocol import DEFAULT_KEY
        from edgetvm.runner import connect
        runner = connect(f"tracker://{rpc_tracker}/{rpc_key or DEFAULT_KEY}", spec=mc.spec,
                         max_workers=workers if workers > 1 else None,
                         call_timeout=timeout)
        return RunnerMeasurer(mc, runner, profile, tasks, lower_workers=workers)
    if workers > 1:
        return ForkMeasurer(mc, tasks, profile, workers, timeout)
    return LocalMeasurer(mc, profile)


def main(argv=None) -> int:
    from edgetvm.build.cli import (add_build_options, add_target_options, parse_build_args,
                                   quantizer_of)

    from .tuner import format_report

    ap = argparse.ArgumentParser(prog="python -m edgetvm.tune",
                                 description=" ".join(__doc__.split()))
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                    help="ONNX file (default: the bundled example)")
    add_target_options(ap, buckets_default=None)
    add_build_options(ap)
    budget = ap.add_mutually_exclusive_group(required=True)
    budget.add_argument("--trials", type=int, default=None, metavar="N",
                        help="measurements to make in this run")
    budget.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="seconds to tune for")
    ap.add_argument("--phases", default=None, metavar="P1,P2",
                    help="tune only these programs: phase names (prefill, decode) or "
                         "program names (decode_1x4p)")
    ap.add_argument("--log", default="tuning_logs", metavar="DIR",
                    help="tuning log directory (default tuning_logs/)")
    ap.add_argument("--workers", type=int, default=1, metavar="N",
                    help="local emulator processes measuring in parallel; with "
                         "--rpc-tracker, local processes lowering candidates and servers "
                         "used at once (default 1: every free server, lowering here)")
    ap.add_argument("--rpc-tracker", default=None, metavar="HOST:PORT",
                    help="measure on the emulator servers of this TVM RPC tracker")
    ap.add_argument("--rpc-key", default=None, metavar="KEY",
                    help="the servers' key at the tracker (default edgetvm-npu)")
    ap.add_argument("--timeout", type=float, default=300.0, metavar="S",
                    help="seconds a candidate's measurement may take (default 300; enforced with "
                         "--workers N > 1 and --rpc-tracker, where it runs in another "
                         "process)")
    ap.add_argument("--no-cuts", action="store_true",
                    help="keep the strategy's kernel boundaries; tune only the kernels' "
                         "knobs")
    ap.add_argument("--cut-share", type=float, default=CUT_SHARE, metavar="F",
                    help="the share of the budget the search over kernel boundaries may "
                         f"take first (default {CUT_SHARE})")
    ap.add_argument("--batch", type=int, default=8, help="candidates per round (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-model", action="store_true",
                    help="random search, no cost model (the baseline)")
    ap.add_argument("--no-validate", action="store_true",
                    help="skip measuring the whole phase programs, default vs tuned")
    ap.add_argument("--report-json", default=None, metavar="F")
    args = parse_build_args(ap, argv)
    if args.trials is not None and args.trials < 1:
        ap.error("--trials must be >= 1")
    if args.time_budget is not None and args.time_budget <= 0:
        ap.error("--time-budget must be > 0")
    if args.workers < 1 or args.batch < 1:
        ap.error("--workers and --batch must be >= 1")
    if args.rpc_key and not args.rpc_tracker:
        ap.error("--rpc-key goes with --rpc-tracker HOST:PORT")
    if args.rpc_tracker and (":" not in args.rpc_tracker or
                             not args.rpc_tracker.rsplit(":", 1)[1].isdigit()):
        ap.error(f"--rpc-tracker: expected HOST:PORT, got {args.rpc_tracker!r}")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()] if args.phases else None
    try:
        rep = tune(args.model, target=args.target, profile=args.profile,
                   strategy=args.strategy, buckets=args.buckets, chunk=args.chunk,
                   quantize=quantizer_of(args), max_tokens=args.max_tokens, phases=phases,
                   trials=args.trials, time_budget=args.time_budget, log_dir=args.log,
                   workers=args.workers, rpc_tracker=args.rpc_tracker,
                   rpc_key=args.rpc_key, timeout=args.timeout, seed=args.seed,
                   batch=args.batch,
                   use_model=not args.no_model, cuts=not args.no_cuts,
                   cut_share=args.cut_share, validate=not args.no_validate,
                   progress=not args.quiet)
    except EdgeTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(rep))
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    return 0
