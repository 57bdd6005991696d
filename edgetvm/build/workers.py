"""A build's programs compiled side by side in forked processes.

The programs of a build (prefill per length bucket and KV capacity, decode per capacity)
are independent once the compiler has their phase graphs and partitions: each lowers the
kernels it has not met, links them and is encoded on its own. :func:`compile_programs`
makes the graphs and partitions here (an ``edgellm`` search runs once, in this process),
forks ``jobs`` workers that inherit them, and hands out the programs largest first (the
longest is started first: on SmolLM2 the prefill of 512 rows at KV 1024 is a third of the
work). A worker sends back each program encoded (its file's bytes), the weights its
earlier programs did not carry, the kernels it lowered and the tuning records it replayed,
so the artifact is the one a serial build writes, byte for byte (a test compares them).

A kernel two workers both need is lowered by each (the cache is per process), which costs
less than the wait serial lowering would. A worker's error is the build's; a worker that
dies is a :class:`BuildError` (``concurrent.futures`` notices, where a
``multiprocessing.Pool`` would wait for it forever). ``jobs=1`` compiles in this process.
"""
from __future__ import annotations

import os

from .graph import BuildError
from .package import check_same_weight, encode_program

_FORKED = None          # (compiler, {weight name: array} a worker has sent) in a worker


#: the most workers a build forks unless asked (each holds its own lowered kernels and
#: programs: up to ~2 GB for SmolLM2-135M)
MAX_DEFAULT_JOBS = 4


def default_jobs() -> int:
    """The CPUs this process may use, at most :data:`MAX_DEFAULT_JOBS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:               # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_DEFAULT_JOBS))


def _cost(key) -> int:
    """A program's size, to start the largest first: rows x KV pages."""
    _, rows, pages = key
    return rows * pages


def compile_programs(mc, keys, jobs: int = 1, on_done=None):
    """``(encoded, pack)``: key -> :class:`~edgetvm.build.package.EncodedProgram` for each
    of ``keys`` (phase, rows, pages) and the weights they name, compiled by ``mc`` in
    ``jobs`` processes. ``on_done(key)`` after each program (a progress bar). What the
    workers lowered and replayed is merged into ``mc`` (``kernels.lowered_keys``, the
    replay's records), as if it had compiled them itself."""
    keys = list(keys)
    jobs = max(1, min(int(jobs), len(keys)))
    encoded, pack = {}, {}
    if jobs == 1:
        for key in keys:
            encoded[key] = encode_program(mc.program(*key), pack)
            if on_done:
                on_done(key)
        return encoded, pack
    for key in keys:                     # graphs and partitions: made once, inherited
        mc.groups(*key)
    global _FORKED
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    _FORKED = (mc, {})
    pool = ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork"))
    try:
        order = sorted(keys, key=_cost, reverse=True)      # stable: ties keep their order
        futures = [pool.submit(_compile, key) for key in order]
        for fut in as_completed(futures):
            key, enc, weights, lowered, used = fut.result()
            encoded[key] = enc
            for name, a in weights.items():
                if name in pack:
                    check_same_weight(name, pack[name], a)
                else:
                    pack[name] = a
            mc.kernels.lowered_keys |= lowered
            replay_used = getattr(mc.knobs_for, "used", None)
            if replay_used is not None:
                replay_used.update(used)
            if on_done:
                on_done(key)
    except BrokenProcessPool:
        raise BuildError(f"a build worker died (killed, or out of memory?); `-j 1` "
                         f"compiles in one process, `-j N` in fewer than {jobs}") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _FORKED = None
    return encoded, pack


def _compile(key):
    """In a worker: one program, encoded, with what the parent does not have yet."""
    mc, held = _FORKED
    before = set(held)
    lowered_before = set(mc.kernels.lowered_keys)
    replay_used = getattr(mc.knobs_for, "used", None)
    enc = encode_program(mc.program(*key, keep=False), held)
    weights = {n: held[n] for n in held.keys() - before}
    used = dict(replay_used) if replay_used is not None else {}
    return key, enc, weights, mc.kernels.lowered_keys - lowered_before, used
