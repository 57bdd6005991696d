"""Measuring on emulator servers behind a TVM RPC tracker: the same cycles as a local
measurement, spread over the servers; a lost server is a failed trial."""
import pathlib

import pytest
from tune_helpers import logged_tasks
from rpc_helpers import (KEY, expect_listening, free_port, start_server, start_tracker, stop,
                         wait_for_free_servers)

from edgetvm.target.emulator import Emulator
from edgetvm.tune.cli import tune
from edgetvm.tune.log import OK, OVER_BUDGET, TuningLog
from edgetvm.tune.measure import measure_candidate

LLAMA = str(pathlib.Path(__file__).resolve().parents[1] / "data" / "llama_tiny_with_past.onnx")


@pytest.fixture(scope="module")
def tracker():
    tport, ports = free_port(), [free_port(), free_port()]
    procs = []
    try:
        procs.append(start_tracker(tport))
        servers = [start_server(p, "--tracker", f"127.0.0.1:{tport}") for p in ports]
        procs += servers
        for p, proc in zip(ports, servers):
            expect_listening(proc, p)
        wait_for_free_servers(tport, 2)
        yield tport
    finally:
        stop(procs)


@pytest.mark.parametrize("profile,workers", [("low-battery", 1), ("performance", 2)])
def test_tracker_measures_what_a_local_run_measures(tracker, tmp_path, profile, workers):
    """... with candidates lowered here, or by ``workers`` forked processes."""
    d = str(tmp_path / "log")
    rep = tune(LLAMA, buckets=(16,), max_tokens=64, phases=["prefill_16x4p", "decode_1x4p"],
               trials=24, log_dir=d, rpc_tracker=f"127.0.0.1:{tracker}", rpc_key=KEY,
               profile=profile, progress=False, seed=2, workers=workers)
    assert rep["measured"] == 24
    recs = [r for r in TuningLog(d).trials() if r.status in (OK, OVER_BUDGET)]
    assert len(recs) == 24
    mc, tasks = logged_tasks(LLAMA, d, [("prefill", 16, 4), ("decode", 1, 4)], profile,
                             max_tokens=64, max_rows=16)
    emu = Emulator(mc.spec, profile)
    for r in recs:
        m = measure_candidate(mc, tasks[r.workload], r.knobs, emu)
        # one cycle apart at most: a throttled clock's time is a float, rounded per run,
        # and the runner's figure is a difference of four runs, the local one of two
        assert abs(r.cycles - m.cycles) <= (0 if profile == "performance" else 1), r.name
        assert (r.dram_bytes, r.peak_power_mw) == (m.dram_bytes, round(m.peak_power_mw, 3))
        if r.status == OVER_BUDGET:
            assert m.over_budget(mc.spec.profile(profile).budget_mw)


def test_a_key_no_server_has_is_refused_at_once(tracker, tmp_path):
    """A --rpc-key no server registered under: refused before any trial (each trial waited
    60 s for a server that never came)."""
    import time

    from edgetvm.errors import EdgeTVMError
    t0 = time.time()
    with pytest.raises(EdgeTVMError, match="no emulator server is registered under key "
                                           "'no-such-key'"):
        tune(LLAMA, buckets=(16,), max_tokens=64, phases=["decode_1x4p"], trials=4,
             log_dir=str(tmp_path / "log"), rpc_tracker=f"127.0.0.1:{tracker}",
             rpc_key="no-such-key", progress=False)
    assert time.time() - t0 < 45
    assert not TuningLog(str(tmp_path / "log")).records()


def test_each_worker_measures_on_a_server_session_of_its_own(tracker):
    """``workers=2`` with a tracker: two forked workers, each lowering its candidates and
    running them on a server session it holds between batches (no program crosses the
    pool's pipes, no session is opened per batch). While the measurer lives both servers
    are held; closing it frees them. The measurements equal local ones."""
    from edgetvm.build.compiler import ModelCompiler
    from edgetvm.runner import TrackerRunner
    from edgetvm.tune.cli import make_measurer
    from edgetvm.tune.measure import ForkMeasurer
    from edgetvm.tune.tasks import extract_tasks

    mc = ModelCompiler(LLAMA, max_tokens=64, max_rows=16)
    tasks = [t for t in extract_tasks(mc, [("decode", 1, 4)]) if t.kind != "partition"]
    task = max(tasks, key=lambda t: t.space_size)
    m = make_measurer(mc, tasks, "performance", workers=2, rpc_tracker=f"127.0.0.1:{tracker}",
                      rpc_key=KEY, timeout=60)
    assert isinstance(m, ForkMeasurer) and m.device is not None
    probe = TrackerRunner("127.0.0.1", tracker, KEY)
    try:
        batch = [task.default_knobs] * 4
        for _ in range(2):
            results = m.measure(task, batch)
            local = measure_candidate(mc, task, task.default_knobs,
                                      Emulator(mc.spec, "performance"))
            assert [r.cycles for r, _ in results] == [local.cycles] * 4
        assert probe.servers() == {"total": 2, "free": 0, "pending": 0}
    finally:
        m.close()
        probe.close()
    wait_for_free_servers(tracker, 2)        # closing the measurer ended the sessions


def test_more_workers_than_servers_measure_with_one_per_server(tracker, capsys):
    """``--workers 3`` against a tracker of 2 servers: a third worker would wait for a
    server and fail each candidate it took after the request timeout; the tuner says so
    and measures with 2, saying so once per tune."""
    from edgetvm.build.compiler import ModelCompiler
    from edgetvm.tune.cli import make_measurer
    from edgetvm.tune.tasks import extract_tasks

    mc = ModelCompiler(LLAMA, max_tokens=64, max_rows=16)
    tasks = extract_tasks(mc, [("decode", 1, 4)])
    said: set = set()                        # the notices one tune has printed
    m = make_measurer(mc, tasks, "performance", workers=3, rpc_tracker=f"127.0.0.1:{tracker}",
                      rpc_key=KEY, timeout=60, notices=said)
    try:
        assert m.workers == 2
        assert "--workers 3: the tracker has 2 server(s)" in capsys.readouterr().err
    finally:
        m.close()
    wait_for_free_servers(tracker, 2)
    # a tune's next stage (tiles after cut points) makes another: said once, not again
    m = make_measurer(mc, tasks, "performance", workers=3, rpc_tracker=f"127.0.0.1:{tracker}",
                      rpc_key=KEY, timeout=60, notices=said)
    try:
        assert m.workers == 2
        assert "--workers" not in capsys.readouterr().err
    finally:
        m.close()
    wait_for_free_servers(tracker, 2)
