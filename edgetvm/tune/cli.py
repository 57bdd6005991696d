"""``python -m edgetvm.tune model.onnx``: tune the kernel boundaries and the kernels of a
model's phase programs on the emulated NPU, appending every trial to a tuning log that
``python -m edgetvm.build model.onnx --log DIR`` replays."""
from __future__ import annotations

import argparse
import json
import os
import sys

from edgetvm import interrupt
from edgetvm.collector import fewer_collections
from edgetvm.errors import (EdgeTVMError, check_input_file, check_not_overwriting,
                            check_output_file)
from edgetvm.runtime.model import program_name

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "llama_tiny_with_past.onnx")


#: the share of a round's budget the cut points may take (the rest tunes the kernels)
CUT_SHARE = 0.25
#: at most this many rounds of (cut points, then the kernels of the cuts chosen): a round's
#: tiles that stall (:data:`~edgetvm.tune.tuner.STALL_GAIN`) give the rest of the budget
#: to another round, whose cuts are chosen on the tuned kernels
ROUNDS = 3
#: a stage stalls when its last this many measurements (or a quarter of its measurements,
#: if more) gained too little
STALL_TRIALS = 128


def select_keys(keys: list, phases) -> list:
    """The (phase, rows, pages) of ``keys`` named by ``phases`` (phase names, e.g.
    ``decode``, or program names, e.g. ``prefill_16x1p``)."""
    if not phases:
        return list(keys)
    names = {program_name(k): k for k in keys}
    out = []
    for want in phases:
        hit = [k for k in keys if k[0] == want] or ([names[want]] if want in names else [])
        if not hit:
            raise EdgeTVMError(f"--phases: no program {want!r}; the build has "
                               f"{', '.join(sorted(names))}")
        out += [k for k in hit if k not in out]
    return out


def task_kinds(names) -> tuple | None:
    """``names`` (``--kinds``) checked against the tuner's task kinds; ``attention`` means
    both attention kinds. None: every kind."""
    from .cost_model import KINDS
    if not names:
        return None
    out: list = []
    for n in names:
        want = ("decode_attention", "prefill_attention") if n == "attention" else (n,)
        for k in want:
            if k not in KINDS:
                raise EdgeTVMError(f"--kinds: no task kind {n!r}; the kinds are "
                                   f"{', '.join(KINDS)} and attention (both attentions)")
            out.append(k)
    return tuple(dict.fromkeys(out))


@fewer_collections()
def tune(onnx_path: str, *, target="edge-npu-16mb", profile=None, strategy="regions",
         buckets=None, chunk=None, quantize=None, max_tokens=None, phases=None,
         trials=None, time_budget=None, log_dir="tuning_logs", workers=1, rpc_tracker=None,
         rpc_key=None, timeout=300.0, seed=0, batch=8, use_model=True, cuts=True,
         cut_share=CUT_SHARE, rounds=ROUNDS, stall=STALL_TRIALS, validate=True,
         progress=True, kinds=None) -> dict:
    """Tune ``onnx_path``; returns the report (see :meth:`Tuner.report`).

    Cut points and tiles are searched in turns, in up to ``rounds`` rounds on one log and
    one budget. A round (with ``cuts``) first searches the kernel boundaries of every run
    of fusable ops (partition tasks, :mod:`edgetvm.build.cuts`) for at most ``cut_share``
    of the budget left: from the cuts chosen so far (first the strategy's partition), each
    candidate's clusters lowered with their tuned knobs where the log has some. Then it
    tunes the knobs of the kernels of the best partition found, for the rest of the
    budget; but when that stalls (:meth:`~edgetvm.tune.tuner.Tuner.run`, ``stall``) and
    rounds remain, the next round chooses the cuts again on the tuned kernels and tunes
    the clusters those cuts made (``stall``: the least number of measurements that must
    gain too little). A short budget is one round.
    Candidates are measured in this process, on ``workers`` local emulator processes, or
    on the servers of the TVM RPC tracker ``rpc_tracker`` ("HOST:PORT") under
    ``rpc_key`` (``workers`` > 1: as many local processes, each lowering its candidates and
    running them on a server session of its own; 1: lowered here, each batch spread over
    every free server).
    ``validate``: link every selected phase program with the default (the strategy's
    partition, default knobs) and with the replayed log, and measure both
    (``rep["phases"]``). ``kinds``: tune only tasks of these kinds (:func:`task_kinds`;
    the cut points only if ``partition`` is one; otherwise the kernels are those of the
    cut points the log chose, as a build replays them), e.g. the attention kernels after
    their template changed."""
    import math
    import time

    from edgetvm.build.cli import DEFAULT_BUCKETS, prefill_rows
    from edgetvm.build.compiler import ModelCompiler

    from .log import TuningLog, log_context
    from .tasks import extract_partition_tasks, extract_tasks

    check_input_file(onnx_path)
    if int(rounds) != rounds or rounds < 1:
        raise EdgeTVMError(f"--rounds must be a whole number >= 1, not {rounds}")
    if not 0 < cut_share < 1:
        raise EdgeTVMError(f"--cut-share: the share of the budget for cut points must be "
                           f"in (0, 1), not {cut_share}")
    kinds = task_kinds(kinds)
    replay_cuts = False          # kernels only: on the cut points the log chose, not searched
    if kinds is not None and "partition" not in kinds:
        replay_cuts, cuts = cuts, False
    tlog = TuningLog(log_dir)     # a log that cannot be written is refused before the front end
    asked = (chunk,) if chunk else tuple(sorted(set(buckets or DEFAULT_BUCKETS)))
    mc = ModelCompiler(onnx_path, target, quantize=quantize, max_tokens=max_tokens,
                       strategy=strategy, max_rows=max(asked), profile=profile)
    rows = prefill_rows(asked, mc.max_tokens, chunk)
    keys = select_keys(mc.phase_keys(rows, chunked=bool(chunk)), phases)
    ctx = log_context(onnx_path, mc.spec, mc.profile, quantize)
    opts = dict(seed=seed, batch=batch, use_model=use_model, progress=progress)
    rounds = rounds if cuts else 1
    reps: list = []
    t_start = time.time()           # the budget: from here (after the front end)

    def left() -> dict:
        done = sum(r["measured"] for r in reps)
        return dict(trials=None if trials is None else trials - done,
                    time_budget=None if time_budget is None else
                    t_start + time_budget - time.time())

    def exhausted(budget) -> bool:
        return (budget["trials"] is not None and budget["trials"] <= 0) or \
            (budget["time_budget"] is not None and budget["time_budget"] <= 0)

    notices: set = set()     # said once per tune, not once per stage
    with tlog:
        def stage(tasks, name, budget, stall):
            return _stage(mc, tasks, tlog, ctx, name, dict(budget, stall=stall), opts,
                          workers, rpc_tracker, rpc_key, timeout, notices)

        for n in range(1, rounds + 1):
            # a round: the cuts, from those chosen so far (first the strategy's), for at
            # most cut_share of what is left, each candidate's clusters lowered with their
            # tuned knobs where the log has some; then the tiles of the cuts chosen, for
            # the rest, or until they stall and another round may cut otherwise
            last = n == rounds
            suffix = f" {n}" if rounds > 1 else ""
            if exhausted(left()):
                break
            if cuts:
                replay = _replay(log_dir, ctx)
                mc.set_cuts(replay.cuts_for if replay else None)
                ptasks = extract_partition_tasks(mc, keys, knobs_for=replay)
                if ptasks:
                    todo = left()
                    budget = dict(
                        trials=None if trials is None else max(1, math.ceil(
                            todo["trials"] * cut_share)),
                        time_budget=None if time_budget is None else
                        todo["time_budget"] * cut_share)
                    reps.append(stage(ptasks, "cuts" + suffix, budget,
                                      None if n == 1 else stall))
            if cuts or replay_cuts:      # the kernels of the best cut points logged
                replay = _replay(log_dir, ctx)
                mc.set_cuts(replay.cuts_for if replay else None)
            if exhausted(left()):
                break
            tasks = [t for t in extract_tasks(mc, keys) if kinds is None or t.kind in kinds]
            if not tasks:
                if kinds is not None and cuts:
                    break                # only the cut points were asked for
                names = ", ".join(program_name(k) for k in keys)
                raise EdgeTVMError(f"--kinds: the programs {names} have no kernel of kind "
                                   f"{', '.join(sorted(kinds))}")
            reps.append(stage(tasks, "tiles" + suffix, left(), None if last else stall))
            if not reps[-1]["stalled"]:
                break                    # the budget is spent, or every space exhausted
    rep = _merge(reps, time.time() - t_start)
    rep.setdefault("log", tlog.path)     # (--trials 0: no stage ran)
    rep["programs"] = [program_name(k) for k in keys]
    rep["context"] = ctx.as_dict()
    failed = sum(t.get("failed", 0) for t in rep["tasks"])
    if not _replay(log_dir, ctx) and failed:
        # nothing measured: the report says so, and why, rather than a refusal to replay
        first = next((t.get("first_error") for t in rep["tasks"] if t.get("first_error")), "")
        rep["note"] = (f"no candidate was measured: {failed} trial(s) failed" +
                       (f" (first: {first})" if first else "") +
                       "; see the failures in the log" +
                       ("; raise --timeout" if "TimeoutError" in first else ""))
        validate = False
    if validate:
        rep["budget_mw"] = mc.spec.profile(mc.profile).budget_mw
        rep["phases"] = validate_programs(mc, keys, log_dir, ctx, onnx_path, quantize,
                                          max_tokens, strategy, max(asked), profile)
    return rep


def validate_programs(mc, keys, log_dir, ctx, onnx_path, quantize, max_tokens, strategy,
                      max_rows, profile) -> list:
    """Measure each program of ``keys`` whole, with the defaults (``mc``: the strategy's
    partition, default knobs) and as the log's replay builds it, and log both
    (:data:`~edgetvm.tune.log.PROGRAM` records): a build with ``--log`` then builds a
    program the tune made slower (or put over the budget beyond what the governor
    corrects, :func:`~edgetvm.tune.measure.beyond_governor`) with the defaults. A kernel is
    tuned beside its neighbours; a whole program's power windows and governor span
    kernels, and only the whole program says what a step costs.

    Where the linker spread a build's prefetches under compute-bound kernels (a choice its
    cost formulas make, :class:`~edgetvm.build.link.Linker`), that build is measured with
    each prefetch at the end of the kernel before too, and a build with ``--log`` links it
    as it measured faster (:func:`~edgetvm.tune.log.best_builds`)."""
    from edgetvm.build.compiler import ModelCompiler

    from .log import (AT_END, DEFAULTS, SPREAD, TUNED, Replay, TuningLog, best_builds,
                      program_record, program_workload)
    from .measure import beyond_governor

    mc.set_cuts(None)                # the default: the strategy's partition
    mc.spread_for = None             # (and the linker's prefetch placement)
    replay = Replay(log_dir, ctx)
    tuned = ModelCompiler(onnx_path, mc.spec, quantize=quantize, max_tokens=max_tokens,
                          strategy=strategy, max_rows=max_rows, profile=profile,
                          **dict(replay.compiler_options, defaults_for=None, spread_for=None))
    identity = tuned.build_identity()
    assert identity == mc.build_identity(), (identity, mc.build_identity())
    budget = mc.spec.profile(mc.profile).budget_mw
    rows, written = [], []
    with TuningLog(log_dir) as tlog:
        for key in keys:
            name = program_name(key)
            measured = {}                # (build, prefetch) -> Counters
            for build, comp in ((DEFAULTS, mc), (TUNED, tuned)):
                measured[build, SPREAD] = program_counters(comp, key)
                if comp.program(*key).metadata.get("spread_prefetches"):
                    measured[build, AT_END] = program_counters(comp, key, spread=False)
            a, b = measured[DEFAULTS, SPREAD], measured[TUNED, SPREAD]
            over = {}
            for (build, prefetch), c in measured.items():
                # the whole step's governor: over only where even the floor clock is,
                # judged against the defaults' own peak
                over[build, prefetch] = (build, prefetch) != (DEFAULTS, SPREAD) and \
                    beyond_governor(c.peak_power_mw, budget, a.peak_power_mw,
                                    c.min_clock_scale)
                written.append(program_record(ctx, name, identity, replay.selection, build,
                                              c.total_cycles, c.dram_bus_bytes,
                                              c.peak_power_mw, over_budget=over[build, prefetch],
                                              prefetch=prefetch))
                tlog.append(written[-1])
            rows.append(dict(
                program=name, default_cycles=a.total_cycles,
                tuned_cycles=b.total_cycles, default_peak_mw=round(a.peak_power_mw, 1),
                tuned_peak_mw=round(b.peak_power_mw, 1), tuned_over_budget=over[TUNED, SPREAD],
                default_kernels=len(mc.program(*key).metadata["kernels"]),
                tuned_kernels=len(tuned.program(*key).metadata["kernels"]),
                **{f"{build}_at_end_cycles": c.total_cycles
                   for (build, prefetch), c in measured.items() if prefetch == AT_END}))
    builds = best_builds(written, replay.selection)     # what a build with --log builds
    for row in rows:
        row["replayed"], row["prefetch"] = builds.get(
            program_workload(row["program"], identity), (TUNED, SPREAD))
    return rows


def _replay(log_dir: str, ctx):
    """The log's :class:`~edgetvm.tune.log.Replay` for ``ctx`` (None: nothing measured)."""
    from .log import Replay, TuningLogError
    try:
        return Replay(log_dir, ctx)
    except TuningLogError:
        return None


def _stage(mc, tasks, tlog, ctx, name, budget, opts, workers, rpc_tracker, rpc_key,
           timeout, notices=None) -> dict:
    """One tuner over ``tasks`` with ``budget`` (:meth:`Tuner.run`'s keywords)."""
    from .tuner import Tuner

    measurer = make_measurer(mc, tasks, ctx.profile, workers, rpc_tracker, rpc_key,
                             timeout, notices)
    try:
        tuner = Tuner(mc, tasks, tlog, ctx, measurer=measurer, desc=name, **opts)
        return tuner.run(**budget)
    finally:
        measurer.close()


def _merge(reps: list, seconds: float) -> dict:
    """The report of the stages (cut points, then tiles, round after round) as one."""
    if not reps:
        return dict(tasks=[], measured=0, seconds=seconds, step_cycles_default=0,
                    step_cycles_tuned=0, stages=[])
    out = dict(reps[-1])
    # a task tuned in two rounds (same kernel, same neighbours) is one row: the last
    # round's, which counts every trial
    rows: dict = {}
    for r in reps:
        for t in r["tasks"]:
            rows.pop((t["workload"], t["context"]), None)
            rows[t["workload"], t["context"]] = t
    out["tasks"] = list(rows.values())
    out["measured"] = sum(r["measured"] for r in reps)
    out["seconds"] = seconds
    out["stages"] = [dict(stage=r["stage"], measured=r["measured"],
                          seconds=round(r["seconds"], 1), stalled=r["stalled"],
                          step_cycles_default=r["step_cycles_default"],
                          step_cycles_tuned=r["step_cycles_tuned"]) for r in reps]
    return out


def program_counters(mc, key, spread: bool | None = None):
    """The measured Counters of the whole linked phase program ``key`` of compiler ``mc``
    (its kernels with cross-kernel prefetch, at the bucket's full KV capacity; ``spread``:
    see :meth:`~edgetvm.build.compiler.ModelCompiler.program`)."""
    from edgetvm.build.measure import measure_program
    from edgetvm.target.emulator import Emulator

    program = mc.program(*key) if spread is None else mc.program(*key, spread=spread)
    return measure_program(program, mc.graph(*key), mc.layout, Emulator(mc.spec, mc.profile))


def make_measurer(mc, tasks, profile, workers=1, rpc_tracker=None, rpc_key=None,
                  timeout=300.0, notices: set | None = None):
    """The measurer the options ask for (:mod:`edgetvm.tune.measure`); ``notices``: those
    already printed (a tune makes a measurer per stage, cut points then tiles, and says
    each once), None to print every one."""
    from .measure import ForkMeasurer, LocalMeasurer, RunnerDevice, RunnerMeasurer
    if rpc_tracker:
        from edgetvm.rpc_protocol import DEFAULT_KEY
        from edgetvm.runner import connect
        key = rpc_key or DEFAULT_KEY
        url = f"tracker://{rpc_tracker}/{key}"
        runner = connect(url, spec=mc.spec, call_timeout=timeout, hold_sessions=True)
        _wait_for_a_server(runner, rpc_tracker, key)
        servers = runner.servers()["total"]
        if workers > servers:
            # a worker without a server would wait for one, and fail its candidates
            note = (f"--workers {workers}: the tracker has {servers} server(s) under key "
                    f"{key!r}; measuring with {servers} worker(s)")
            if notices is None or note not in notices:
                print(note, file=sys.stderr)
                if notices is not None:
                    notices.add(note)
            workers = servers
        if workers <= 1:   # lowered here, each batch spread over every server
            return RunnerMeasurer(mc, runner, profile, tasks)

        def device():      # in each forked worker: a server session of its own
            return RunnerDevice(connect(url, spec=mc.spec, max_workers=1,
                                        call_timeout=timeout, hold_sessions=True), profile)
        return ForkMeasurer(mc, tasks, profile, workers, timeout, device=device,
                            runner=runner)
    if workers > 1:
        return ForkMeasurer(mc, tasks, profile, workers, timeout)
    return LocalMeasurer(mc, profile)


def _wait_for_a_server(runner, tracker: str, key: str, grace_s: float = 10.0) -> None:
    """Refuse a tracker with no server under ``key`` (after ``grace_s`` for one that is
    starting): every trial would wait its request timeout for a server that never comes."""
    import time
    deadline = time.time() + grace_s
    while runner.servers()["total"] == 0:
        if time.time() > deadline:
            runner.close()
            raise EdgeTVMError(f"no emulator server is registered under key {key!r} at "
                               f"tracker {tracker} (start one: python -m edgetvm.rpc_server "
                               f"--tracker {tracker} --key {key})")
        time.sleep(0.5)


def _tune_cli(args, phases) -> dict:
    """:func:`tune` with the command line's options."""
    from edgetvm.build.cli import quantizer_of
    if args.report_json:
        from edgetvm.build.fingerprint import model_files

        from .log import LOG_FILE
        check_output_file(args.report_json, "--report-json")
        check_not_overwriting(args.report_json, "--report-json", model_files(
            args.model, "the model being tuned") + [
                ("the tuning log", os.path.join(args.log, LOG_FILE))], "report.json")
    return tune(args.model, target=args.target, profile=args.profile,
                strategy=args.strategy, buckets=args.buckets, chunk=args.chunk,
                quantize=quantizer_of(args), max_tokens=args.max_tokens, phases=phases,
                trials=args.trials, time_budget=args.time_budget, log_dir=args.log,
                workers=args.workers, rpc_tracker=args.rpc_tracker,
                rpc_key=args.rpc_key, timeout=args.timeout, seed=args.seed,
                batch=args.batch,
                use_model=not args.no_model, cuts=not args.no_cuts,
                cut_share=args.cut_share, rounds=args.rounds,
                validate=not args.no_validate,
                progress=not args.quiet,
                kinds=[k.strip() for k in args.kinds.split(",") if k.strip()]
                if args.kinds else None)


def _interrupted(log_dir: str) -> None:
    """Ctrl-C: say where the measurements are and exit 130."""
    # every measurement is in the log as it ends (fsynced): nothing is lost
    print(f"\ninterrupted; every measurement made is in {log_dir} (rerun the same "
          f"command to resume: nothing measured is measured again)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # exit now: the interpreter's shutdown (multiprocessing's finalizers) could take a
    # second KeyboardInterrupt and end the process by SIGINT instead of 130
    os._exit(130)


def main(argv=None) -> int:
    from edgetvm.build.cli import add_build_options, add_target_options, parse_build_args

    from .tuner import format_report

    ap = argparse.ArgumentParser(prog="python -m edgetvm.tune",
                                 description=" ".join(__doc__.split()))
    ap.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                    help="ONNX file (default: the bundled example)")
    add_target_options(ap, buckets_default=None)
    add_build_options(ap)
    budget = ap.add_mutually_exclusive_group(required=True)
    budget.add_argument("--trials", type=int, default=None, metavar="N",
                        help="measurements to make in this run (0: none, only the "
                             "whole programs measured against the log, as at a tune's end)")
    budget.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="seconds to tune for")
    ap.add_argument("--phases", default=None, metavar="P1,P2",
                    help="tune only these programs: phase names (prefill, decode) or "
                         "program names (decode_1x4p)")
    ap.add_argument("--kinds", default=None, metavar="K1,K2",
                    help="tune only kernels of these kinds: cluster, prefill_attention, "
                         "decode_attention, attention (both), embedding, partition (the cut "
                         "points); default all")
    ap.add_argument("--log", default="tuning_logs", metavar="DIR",
                    help="tuning log directory (default tuning_logs/)")
    ap.add_argument("--workers", type=int, default=1, metavar="N",
                    help="local emulator processes measuring in parallel; with "
                         "--rpc-tracker, local processes each lowering its candidates and "
                         "running them on a server session of its own (N servers at once; "
                         "default 1: lowering here, each batch spread over every free "
                         "server)")
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
                    help="the share of each round's budget the search over kernel "
                         f"boundaries may take first (default {CUT_SHARE})")
    ap.add_argument("--rounds", type=int, default=ROUNDS, metavar="N",
                    help="at most N turns of (cut points, then the kernels' knobs): when "
                         "the knobs stall, the next round chooses the cuts again on the "
                         f"tuned kernels (default {ROUNDS})")
    ap.add_argument("--batch", type=int, default=8,
                    help="candidates per tuner batch (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-model", action="store_true",
                    help="random search, no cost model (the baseline)")
    ap.add_argument("--no-validate", action="store_true",
                    help="skip measuring the whole phase programs, default vs tuned")
    ap.add_argument("--report-json", default=None, metavar="F")
    args = parse_build_args(ap, argv)
    if args.trials is not None and args.trials < 0:
        ap.error("--trials must be >= 0")
    if args.trials == 0 and args.no_validate:
        ap.error("--trials 0 measures only the whole programs, which --no-validate skips")
    import math
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and
                                             args.time_budget > 0):
        ap.error("--time-budget must be a finite number of seconds > 0")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        ap.error("--timeout must be a finite number of seconds > 0")
    if args.kinds and args.no_cuts and "partition" in args.kinds.split(","):
        ap.error("--kinds partition tunes the cut points, which --no-cuts leaves out")
    if args.workers < 1 or args.batch < 1:
        ap.error("--workers and --batch must be >= 1")
    if args.rpc_key and not args.rpc_tracker:
        ap.error("--rpc-key goes with --rpc-tracker HOST:PORT")
    if args.rpc_tracker and (":" not in args.rpc_tracker or
                             not args.rpc_tracker.rsplit(":", 1)[1].isdigit()):
        ap.error(f"--rpc-tracker: expected HOST:PORT, got {args.rpc_tracker!r}")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()] if args.phases else None
    parent = os.path.dirname(os.path.abspath(args.log))
    if not os.path.exists(args.log) and not os.path.isdir(parent):
        # a mistyped path would start a new, empty log somewhere else
        ap.error(f"--log {args.log}: no directory {parent} (a new log's directory is "
                 f"created, not its parents)")
    try:
        with interrupt.watching():
            rep = _tune_cli(args, phases)
            interrupt.check()            # pressed where TVM made an error of it
    except EdgeTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        _interrupted(args.log)
    print(format_report(rep))
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    return 0
