"""The tuning log: durable one-line records, concurrent appenders, torn lines, kill -9,
context-keyed lookup and refusals that name the key that differs."""
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from edgetvm.tune.log import (FAILED, OK, REJECTED, LogContext, Record, Replay, TuningLog,
                              TuningLogError, canonical_knobs, workload_hash)

CTX = LogContext("m" * 64, "spechash", "performance", "none", "0.1.0", 3)


def rec(i, cycles=100, ctx=CTX, workload="w0", status=OK, knobs=None):
    return Record(ctx, workload, "cluster", f"k{i}", knobs or {"tile_m": i},
                  status, cycles=cycles if status == OK else None,
                  error=None if status == OK else "boom")


def test_records_round_trip_one_line_each(tmp_path):
    with TuningLog(str(tmp_path / "log")) as tl:
        tl.append(rec(1, 50))
        tl.append(rec(2, status=FAILED))
        tl.append(rec(3, status=REJECTED))
    raw = (tmp_path / "log" / "records.jsonl").read_bytes()
    assert raw.count(b"\n") == 3 and raw.endswith(b"\n")
    got = TuningLog(str(tmp_path / "log")).records()
    assert [(r.name, r.status, r.cycles, r.knobs) for r in got] == \
        [("k1", OK, 50, {"tile_m": 1}), ("k2", FAILED, None, {"tile_m": 2}),
         ("k3", REJECTED, None, {"tile_m": 3})]
    assert got[0].context == CTX and got[1].error == "boom"


def test_best_per_workload_ignores_failures_and_breaks_ties_by_knobs():
    records = [rec(1, 90), rec(2, 80), rec(3, 80), rec(4, 10, status=FAILED),
               rec(5, 70, workload="w1"), rec(6, 60, workload="w1", status=REJECTED)]
    best = TuningLog.best(records)
    assert best["w0"].cycles == 80 and best["w0"].knobs == {"tile_m": 2}
    assert best["w1"].cycles == 70
    # the choice does not depend on the order of the log
    assert TuningLog.best(records[::-1])["w0"].knobs == {"tile_m": 2}


def test_best_never_compares_cycles_of_different_measuring_contexts(tmp_path):
    """Cycles in context depend on the neighbours: a record measured beside other kernels
    (another partition, another selection of programs) is not compared; the context
    measured last wins (the latest run tuned the partition a replay builds)."""
    import dataclasses
    a = [dataclasses.replace(rec(i, c), neighbours="aaaa", time=1000.0 + i)
         for i, c in ((1, 100), (2, 90), (3, 95))]
    b = [dataclasses.replace(rec(9, 10), neighbours="bbbb", time=999.0)]
    assert TuningLog.best(a + b)["w0"].cycles == 90
    assert TuningLog.best(b + a)["w0"].cycles == 90
    c = [dataclasses.replace(rec(8, 97), neighbours="cccc", time=2000.0)]
    assert TuningLog.best(a + b + c)["w0"].cycles == 97       # not 10, not 90
    # a version-1 record (measured alone) loads, in the context ""
    with TuningLog(str(tmp_path / "log")) as tl:
        tl.append(a[0])
    line = json.loads((tmp_path / "log" / "records.jsonl").read_text())
    assert line["neighbours"] == "aaaa"
    line.update(v=1)
    del line["neighbours"]
    (tmp_path / "log" / "records.jsonl").write_text(json.dumps(line) + "\n")
    (old,) = TuningLog(str(tmp_path / "log")).records()
    assert old.neighbours == "" and old.cycles == 100


def test_torn_last_line_is_skipped_with_a_warning_and_the_next_writer_ends_it(tmp_path, caplog):
    d = str(tmp_path / "log")
    with TuningLog(d) as tl:
        for i in range(3):
            tl.append(rec(i))
    line = rec(9).to_json().encode()
    with open(os.path.join(d, "records.jsonl"), "ab") as f:
        f.write(line[:len(line) // 2])            # a kill in the middle of a write
    with caplog.at_level(logging.WARNING, logger="edgetvm"):
        tl = TuningLog(d)
        got = tl.records()
    assert [r.name for r in got] == ["k0", "k1", "k2"] and tl.skipped == 1
    assert "torn" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgetvm"):     # a tune reads it again:
        assert len(TuningLog(d).records()) == 3                   # said once per process
    assert "skipped" not in caplog.text
    with TuningLog(d) as tl:                      # resumes appending after the torn line
        tl.append(rec(4))
    got = TuningLog(d).records()
    assert [r.name for r in got] == ["k0", "k1", "k2", "k4"]


def test_a_damaged_line_in_the_middle_does_not_abort_the_load(tmp_path, caplog):
    d = tmp_path / "log"
    d.mkdir()
    good = [rec(i).to_json() for i in range(3)]
    bad = json.dumps({"v": 1, "status": "ok"})          # parses, but is no record
    # JSON that is not an object, and a partition record whose cuts are not integers
    # (replaying it raised AttributeError / ValueError)
    cut = json.loads(Record(CTX, "w9", "partition", "run", {"cuts": ["x"]}, OK,
                            cycles=1).to_json())
    (d / "records.jsonl").write_text("\n".join([good[0], "{not json", good[1], bad, "null",
                                                "[1, 2]", json.dumps(cut), good[2]]) + "\n")
    with caplog.at_level(logging.WARNING, logger="edgetvm"):
        tl = TuningLog(str(d))
        assert [r.name for r in tl.records()] == ["k0", "k1", "k2"]
    assert tl.skipped == 5 and "unreadable" in caplog.text
    assert "cuts are not a list of integers" in caplog.text


WRITER = textwrap.dedent("""
    import sys, time
    from edgetvm.tune.log import LogContext, Record, TuningLog
    ctx = LogContext("m" * 64, "spechash", "performance", "none", "0.1.0", 3)
    who, n = sys.argv[2], int(sys.argv[3])
    with TuningLog(sys.argv[1]) as tl:
        print("ready", flush=True)
        i = 0
        while n < 0 or i < n:
            tl.append(Record(ctx, "w", "cluster", who, {"seq": i, "pad": "x" * (i % 50)},
                             "ok", cycles=i + 1))
            i += 1
""")


def _writer(tmp_path, d, who, n):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    return subprocess.Popen([sys.executable, str(script), d, who, str(n)],
                            stdout=subprocess.PIPE, text=True)


def test_two_processes_appending_to_one_log_lose_nothing(tmp_path):
    d = str(tmp_path / "log")
    n = 300
    procs = [_writer(tmp_path, d, who, n) for who in ("a", "b")]
    for p in procs:
        assert p.wait(timeout=120) == 0
    tl = TuningLog(d)
    got = tl.records()
    assert tl.skipped == 0
    for who in ("a", "b"):
        assert sorted(r.knobs["seq"] for r in got if r.name == who) == list(range(n))
    assert len(got) == 2 * n


def test_kill_9_mid_tuning_loses_no_record_and_duplicates_none(tmp_path):
    d = str(tmp_path / "log")
    p = _writer(tmp_path, d, "a", -1)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.7)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    got = TuningLog(d).records()
    seqs = [r.knobs["seq"] for r in got]
    assert len(seqs) > 10
    assert seqs == list(range(len(seqs)))        # in order, none lost, none twice


def test_context_mismatch_is_refused_naming_the_key(tmp_path):
    d = str(tmp_path / "log")
    with TuningLog(d) as tl:
        tl.append(rec(1, 50, workload=workload_hash("K")))
    for field, value in (("spec", "otherspec"), ("profile", "balanced"),
                         ("quantization", '{"group_size": 32}'), ("edgetvm", "0.2.0"),
                         ("emulator", 4), ("model", "f" * 64)):
        other = LogContext(**{**CTX.as_dict(), field: value})
        with pytest.raises(TuningLogError) as e:
            Replay(d, other)
        msg = str(e.value)
        assert f"{field} is {value!r} here" in msg
        assert [k for k in ("model", "spec", "profile", "quantization", "edgetvm", "emulator")
                if f"{k} is" in msg] == [field]
    r = Replay(d, CTX)
    assert r("K") == {"tile_m": 1} and r("other kernel") is None
    assert r.summary()["kernels_tuned"] == 1


def test_a_missing_or_empty_log_is_refused(tmp_path):
    with pytest.raises(TuningLogError, match="no such tuning log"):
        Replay(str(tmp_path / "nope"), CTX)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TuningLogError, match="no tuning records"):
        Replay(str(tmp_path / "empty"), CTX)


def test_a_log_path_that_is_a_file_is_refused_before_anything_is_measured(tmp_path):
    f = tmp_path / "records"
    f.write_text("not a directory\n")
    with pytest.raises(TuningLogError, match="not a directory"):
        TuningLog(str(f))
    with pytest.raises(TuningLogError, match="not a directory"):     # to replay (build)
        Replay(str(f), CTX)
    with pytest.raises(TuningLogError, match="cannot create"):
        TuningLog(str(f / "below"))
    assert f.read_text() == "not a directory\n"


def test_canonical_knobs_is_order_independent():
    assert canonical_knobs({"b": 1, "a": {"y": 2, "x": 1}}) == \
        canonical_knobs({"a": {"x": 1, "y": 2}, "b": 1})


def test_resume_matches_records_of_this_context_only(tmp_path):
    # what a resume takes as measured: a record that differs in any one key (quantization,
    # profile, spec, ...) measured another program and must not count, nor its cycles
    import dataclasses
    from edgetvm.tune.log import CONTEXT_KEYS
    d = str(tmp_path / "log")
    with TuningLog(d) as tl:
        tl.append(rec(0, cycles=500))
        for i, key in enumerate(CONTEXT_KEYS, 1):
            other = {"emulator": CTX.emulator + 1}.get(key, f"other-{key}")
            tl.append(rec(i, cycles=1, ctx=dataclasses.replace(CTX, **{key: other})))
    got = TuningLog(d).matching(CTX)
    assert [(r.name, r.cycles) for r in got] == [("k0", 500)]
    assert len(TuningLog(d).records()) == 1 + len(CONTEXT_KEYS)


def test_program_records_decide_which_programs_a_replay_builds_with_the_defaults(tmp_path):
    """Whole-program records of the replay's own selection and of the building compiler's
    identity decide: defaults faster, or the tuned program over the budget where the
    defaults are not -> built with the defaults; the latest record of a (program, build)
    counts; records of another selection (the log's best knobs changed since), of another
    identity (strategy, KV capacity, largest bucket) and program records as kernels' best
    are ignored."""
    from edgetvm.tune.log import DEFAULTS, PROGRAM, TUNED, program_record
    d = str(tmp_path / "log")
    with TuningLog(d) as tl:
        tl.append(rec(1, 50, workload=workload_hash("K")))
    sel = Replay(d, CTX).selection
    ident = {"strategy": "local", "max_tokens": 1024, "max_rows": 512}
    other = dict(ident, strategy="regions")

    def prog(name, build, cycles, selection=sel, over=False, t=0.0, identity=ident):
        r = program_record(CTX, name, identity, selection, build, cycles, 10, 500.0,
                           over_budget=over)
        return dataclasses.replace(r, time=1000.0 + t)

    with TuningLog(d) as tl:
        for r in (prog("a", DEFAULTS, 100), prog("a", TUNED, 90),              # tuned won
                  prog("b", DEFAULTS, 100), prog("b", TUNED, 101),             # defaults won
                  prog("c", DEFAULTS, 100), prog("c", TUNED, 50, over=True),   # over budget
                  prog("d", DEFAULTS, 100), prog("d", TUNED, 120),
                  prog("d", TUNED, 95, t=1),                                   # measured again
                  prog("e", DEFAULTS, 100), prog("e", TUNED, 120, selection="x" * 64),
                  prog("f", TUNED, 120),                                       # no defaults
                  prog("a", DEFAULTS, 100, identity=other),
                  prog("a", TUNED, 120, identity=other)):
            tl.append(r)
    r = Replay(d, CTX)
    assert r.selection == sel                # program records are not kernels' best
    names = "abcdef"
    assert [n for n in names if r.builds_defaults(n, ident)] == ["b", "c"]
    assert [n for n in names if r.builds_defaults(n, other)] == ["a"]
    assert r.compiler_options["defaults_for"]("b", ident)
    assert r("K") == {"tile_m": 1} and PROGRAM not in {x.kind for x in r.best.values()}
    # a new best for K: another selection, judged by none of those records
    with TuningLog(d) as tl:
        tl.append(rec(2, 40, workload=workload_hash("K")))
    r = Replay(d, CTX)
    assert r.selection != sel and not any(r.builds_defaults(n, ident) for n in names)


def test_program_records_decide_where_a_replay_links_the_prefetches(tmp_path):
    """Where a program was measured with its prefetches spread and with each at the end of
    the kernel before, in either build: the fastest within the budget is built (the
    fastest of all if none is within it), a tie going to the tuned, spread build, then the
    tuned one at the end; a record without a placement is of a spread build; without the
    tuned, spread build's record nothing is judged."""
    from edgetvm.tune.log import AT_END, DEFAULTS, SPREAD, TUNED, program_record
    d = str(tmp_path / "log")
    with TuningLog(d) as tl:
        tl.append(rec(1, 50, workload=workload_hash("K")))
    sel = Replay(d, CTX).selection
    ident = {"strategy": "local", "max_tokens": 1024, "max_rows": 512}

    def prog(name, build, prefetch, cycles, over=False, t=0.0):
        r = program_record(CTX, name, ident, sel, build, cycles, 10, 500.0,
                           over_budget=over, prefetch=prefetch)
        return dataclasses.replace(r, time=1000.0 + t)

    def unplaced(r):                              # as records were before placements
        return dataclasses.replace(r, knobs={k: v for k, v in r.knobs.items()
                                             if k != "prefetch"})

    T, D, S, E = TUNED, DEFAULTS, SPREAD, AT_END
    with TuningLog(d) as tl:
        for r in (prog("a", T, S, 100), prog("a", T, E, 90), prog("a", D, S, 120),
                  prog("b", T, S, 100), prog("b", T, E, 100),                   # a tie
                  prog("c", T, S, 100), prog("c", D, S, 120), prog("c", D, E, 95),
                  prog("c", T, E, 101),
                  prog("d", T, S, 100, over=True), prog("d", T, E, 80, over=True),
                  prog("d", D, S, 110), prog("d", D, E, 105, over=True),
                  prog("e", T, E, 50), prog("e", D, S, 100),          # no tuned, spread
                  unplaced(prog("f", T, S, 100)), prog("f", T, E, 120),
                  prog("f", T, E, 99, t=1),                           # measured again
                  prog("g", T, S, 100, over=True), prog("g", T, E, 90, over=True),
                  prog("h", T, S, 100), prog("h", D, E, 100)):                  # a tie
            tl.append(r)
    r = Replay(d, CTX)
    assert r.selection == sel
    names = "abcdefgh"
    assert [n for n in names if not r.spreads(n, ident)] == ["a", "c", "f", "g"]
    assert [n for n in names if r.builds_defaults(n, ident)] == ["c", "d"]
    assert r.compiler_options["spread_for"]("b", ident)
    assert not r.spreads("a", ident) and r.spreads("a", dict(ident, strategy="mega"))
    with pytest.raises(ValueError, match="prefetch"):
        program_record(CTX, "a", ident, sel, T, 1, 1, 1.0, prefetch="middle")
