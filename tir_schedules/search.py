"""A simple search over a template's knobs, measured on the emulator.

This is the baseline the XGBoost-guided tuner is measured against, and what
``benchmarks/kernels.py`` uses: read the knob space from the template's sampling
instructions, enumerate it (or sample it when it is large), lower every candidate, run it
on the emulator, keep the fastest. Candidates that do not fit the TCM are rejected by the
lowering (:class:`CandidateRejected`) before they reach the emulator.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

import tvm

from edgetvm.errors import CandidateRejected

from .common import new_schedule


def knob_space(sch, names) -> dict:
    """name -> candidate values, read from the template's SampleCategorical instructions."""
    cats = [inst for inst in sch.trace.insts if inst.kind.name == "SampleCategorical"]
    if len(cats) != len(names):
        raise ValueError(f"template sampled {len(cats)} knobs, expected {list(names)}")
    return {n: [int(c) for c in inst.attrs[0]] for n, inst in zip(names, cats)}


def sampled_knobs(sch, names) -> dict:
    """name -> the value this schedule took for each knob."""
    tr = sch.trace
    cats = [inst for inst in tr.insts if inst.kind.name == "SampleCategorical"]
    return {n: int(inst.attrs[0][int(tr.decisions[inst])]) for n, inst in zip(names, cats)}


@dataclass
class Candidate:
    knobs: dict
    cycles: int | None = None
    counters: dict | None = None
    program: object = None
    rejected: str | None = None


@dataclass
class SearchResult:
    best: Candidate | None
    candidates: list = field(default_factory=list)

    @property
    def measured(self) -> list:
        return [c for c in self.candidates if c.cycles is not None]


def search(func, schedule_fn, knob_names, lower_fn, run_fn, trials: int = 32, seed: int = 0,
           fixed: dict | None = None, progress=None) -> SearchResult:
    """Grid-search the knob space when it has at most ``trials`` points; else sample half
    the budget at random and spend the rest hill-climbing from the best point (one knob
    changed at a time).

    Parameters
    ----------
    func : the workload PrimFunc.
    schedule_fn : ``schedule_fn(sch, **knobs)`` applies the template.
    knob_names : the template's knob names, in sampling order.
    lower_fn : ``lower_fn(scheduled_primfunc) -> Program`` (may raise CandidateRejected).
    run_fn : ``run_fn(program) -> Counters`` (an emulator run).
    fixed : knobs pinned to one value.
    """
    fixed = dict(fixed or {})
    mod = tvm.IRModule({"main": func})
    probe = new_schedule(mod, seed=seed + 1)   # s_tir seeds start at 1
    schedule_fn(probe, **fixed)
    space = knob_space(probe, knob_names)
    counter = iter(range(2, 1 << 30))

    def build(knobs):
        sch = new_schedule(mod, seed=seed + next(counter))
        schedule_fn(sch, **knobs)
        return lower_fn(sch.mod["main"])
    return search_space(space, build, run_fn, trials, seed, progress)


def search_space(space: dict, build_fn, run_fn, trials: int = 32, seed: int = 0,
                 progress=None) -> SearchResult:
    """The search loop over an explicit knob space (name -> candidate values).

    ``build_fn(knobs) -> Program`` may raise :class:`CandidateRejected`."""
    points = list(itertools.product(*space.values()))
    rng = random.Random(seed)
    result = SearchResult(None)
    seen: set = set()

    def measure(values):
        seen.add(values)
        cand = Candidate(dict(zip(space, values)))
        result.candidates.append(cand)
        try:
            cand.program = build_fn(cand.knobs)
        except CandidateRejected as e:
            cand.rejected = str(e)
            return
        c = run_fn(cand.program)
        cand.cycles, cand.counters = c.total_cycles, c.to_dict()
        if result.best is None or cand.cycles < result.best.cycles:
            result.best = cand
        if progress is not None:
            progress(len(seen), min(trials, len(points)), cand)

    if len(points) <= trials:
        for values in points:
            measure(values)
        return result
    for values in rng.sample(points, trials // 2):
        measure(values)
    while len(seen) < trials and result.best is not None:
        start = tuple(result.best.knobs.values())
        neighbours = [start[:i] + (v,) + start[i + 1:]
                      for i, cands in enumerate(space.values()) for v in cands]
        fresh = [p for p in neighbours if p not in seen]
        rng.shuffle(fresh)
        for values in fresh[:trials - len(seen)]:
            measure(values)
        if tuple(result.best.knobs.values()) == start:
            # a local optimum: restart from a few fresh random points
            unseen = [p for p in rng.sample(points, min(len(points), 4 * trials))
                      if p not in seen][:max(1, trials // 8)]
            for values in unseen[:trials - len(seen)]:
                measure(values)
    return result
