"""The tuner: per task, candidates ranked by the cost model and measured on the emulator;
a gradient task scheduler spends the trials; every trial goes to the log as it ends.

A task is a kernel's knobs (:class:`~edgetvm.tune.tasks.Task`) or the cuts of a run of
fusable ops (:class:`~edgetvm.tune.tasks.PartitionTask`); both are searched, measured and
logged alike. ``python -m edgetvm.tune`` runs one tuner over the partition tasks, then one
over the kernels of the partition it chose (:func:`edgetvm.tune.cli.tune`).

Loop (MetaSchedule's shape: ``TaskScheduler`` -> ``SearchStrategy`` -> ``CostModel`` ->
``Runner`` -> ``Database``, here over the NPU's knob records):

1. the scheduler picks the task whose gradient is largest,
   ``weight * (alpha * backward + (1 - alpha) * forward)``, with ``backward`` the cycles
   its best fell per round over the last rounds and ``forward`` the optimistic
   ``best / (trials + 1)`` (MetaSchedule's ``GradientBased`` task scheduler). Its
   ``weight`` (:meth:`Tuner.weight`) is, summed over the programs it runs in, its
   occurrences there over that program's default cycles: the objective is every
   selected program's latency relative to its own default, each program alike (a
   prefill-16 kernel counts as much for its program as a prefill-512 one for its; by
   summed cycles, the 512-row programs drew most of a short budget). Under a time budget the
   gradient is per second of the task's mean trial time: a prefill attention whose
   candidates take 20 s each yields its turn to a kernel that gains as much in 5 s;
2. a task with no baseline yet has its default knobs measured first (with the next
   baselines, as many as the measurer runs at once); until then its cycles are
   estimated from its bytes (:attr:`~edgetvm.tune.tasks.Task.size_hint`) at the
   measured tasks' cycles per byte. So baselines are measured only for tasks the
   budget reaches, the heaviest first: a baseline alone gains nothing, and measuring
   every task's before tuning any spent a 5-minute budget on baselines alone. A
   baseline already in the log is reused, not measured again;
3. a round proposes ``batch`` unseen candidates: a pool of random points and the
   neighbours of the best one (one knob changed), ranked by the XGBoost model (a quarter
   of the batch stays random, for exploration); before the model has data, by its
   analytic prior (a cluster's or an attention kernel's estimated latency from its tiles
   and the spec's per-command costs, a run's from its cuts), and at random where there
   is none (an embedding). For a
   run's cuts the pool first grows by the neighbours of the points the model ranks
   highest (:data:`GUIDED_KINDS`), and every run has a round before any has a second
   (:meth:`Tuner._pick`);
4. each candidate is lowered (a TCM overflow is a *rejected* record, never measured),
   relocated and run on the emulator (an error is a *failed* record); the measured
   ones train the model. Nothing already in the log is tried again (resume).

MetaSchedule's ``TaskScheduler`` and ``SearchStrategy`` are not subclassed: both work on
``TuneContext`` objects whose space is an s_tir schedule trace and whose candidates are
``MeasureCandidate`` (a schedule plus argument info). The attention and embedding
templates have no trace to mutate, and a candidate here is a knob set that
:class:`~edgetvm.build.kernels.KernelBuilder` lowers on the build's own path; the
scheduler's rule (gradient with a backward window and an optimistic forward estimate) is
MetaSchedule's, over these tasks.

Power: every candidate runs under the profile's governor, so its cycles include the
throttling its power costs. One that puts the step over the profile's budget beyond what
the governor can correct (:meth:`~edgetvm.tune.measure.Measurement.over_budget`) is
logged ``over_budget``, counts as a trial, and is never chosen. When a kernel's default
knobs are over the budget themselves (a bandwidth-bound kernel under ``low-battery``:
the DRAM power alone is over 700 mW, and the clock does not slow DRAM), the limit is the
default's peak instead (:meth:`Tuner.power_limit`): tuning never makes such a kernel draw
more, and does not trade its speed for a budget the rest of the step breaks anyway (a
hard per-kernel budget chose linears 30x slower, and the program stayed over budget).
"""
from __future__ import annotations

import logging
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from edgetvm import interrupt
from edgetvm.errors import CandidateRejected, EdgeTVMError

from .cost_model import CostModel, features
from .log import (AT_END, DEFAULTS, FAILED, OK, OVER_BUDGET, REJECTED, TUNED, Record,
                  canonical_knobs)
from .measure import STOPPED, LocalMeasurer, TooSlow

log = logging.getLogger("edgetvm")


#: a candidate is stopped once it costs this many times the task's best so far (failed,
#: with that lower bound as its cycles)
SLOW = 4

#: candidates issuing more tile operations than this many times the defaults are left out
#: of the space (:meth:`Tuner._affordable`)
MAX_TILE_OPS = 8

#: a stage given ``stall`` stops once its last ``max(stall, a quarter of its measurements)``
#: measurements raised :meth:`Tuner.gain` by less than this (0.2 % of the programs'
#: latency): the tiles of these cuts are about done, the next round may cut otherwise
STALL_GAIN = 0.002

#: ... and only while the tasks without a baseline yet hold less than this share of the
#: programs' latency (a stage that has not reached its heavy kernels is not done)
STALL_UNREACHED = 0.05

#: the note on a baseline record whose default knobs break the budget themselves
DEFAULTS_OVER = "defaults over budget"

#: task kinds whose pool grows by model-guided mutation (:meth:`Tuner._propose`), and how
#: many generations: the cuts of a run, where the prior orders cut sets well (SmolLM2's
#: prefill-128 run: the first candidate proposed was within 5 % of the best on every
#: seed, against 13-32+ trials at random). Not tiles: on the prefill MLP it followed the
#: model's wrong beliefs (median 17-32+ trials to within 5 %, against 11 without).
GUIDED_KINDS = ("partition",)
GUIDED_GENERATIONS = 2

#: per other measuring context of a task's workload (its neighbours changed since), the
#: best knob sets measured there that a tune measures first in the new one
#: (:meth:`Tuner._resume`). Without them a 48-trial tune of SmolLM2's W4A16 prefill-512
#: layer cluster beside a new attention started from the defaults (1.052 M cycles in
#: context) and ended at 0.985 M, where 975 trials beside the old attention had reached
#: 0.951 M (a replay takes the latest context's best). With them the old best came first,
#: 0.958 M beside the new attention, but over the power limit there (the defaults' own
#: peak, lower beside the cooler attention), so it was not chosen either
CARRIED = 4


class TuneError(EdgeTVMError):
    """The tuner cannot run as asked."""


@dataclass
class TaskState:
    task: object
    seen: set = field(default_factory=set)       # canonical knobs tried (any outcome)
    default_cycles: int | None = None
    best_cycles: int | None = None
    best_knobs: dict | None = None
    history: list = field(default_factory=list)  # best cycles after each round
    trials: int = 0              # measured (ok, failed, over budget) this run and before
    rejected: int = 0
    failed: int = 0
    over_budget: int = 0
    exhausted: bool = False
    default_peak_mw: float | None = None
    default_over: bool = False   # the defaults themselves break the budget
    wall_s: float = 0.0          # time spent lowering and measuring its candidates
    walls: int = 0
    first_error: str | None = None
    #: the best knobs of the workload measured beside other neighbours (``CARRIED`` per
    #: context, the latest context first): seeds of this context
    carried: list = field(default_factory=list)

    def offer(self, rec: Record) -> None:
        self.seen.add(rec.knobs_key)
        self.wall_s += rec.wall_s
        self.walls += 1
        if rec.status == REJECTED:
            self.rejected += 1
            return
        self.trials += 1
        if rec.status == FAILED:
            self.failed += 1
            self.first_error = self.first_error or (rec.error or "")[:200]
            return
        if rec.status == OVER_BUDGET:
            self.over_budget += 1
            return
        if self.best_cycles is None or (rec.cycles, rec.knobs_key) < \
                (self.best_cycles, canonical_knobs(self.best_knobs)):
            self.best_cycles, self.best_knobs = rec.cycles, rec.knobs


class Tuner:
    """Tunes the kernels of ``tasks`` (from :func:`~edgetvm.tune.tasks.extract_tasks`) of
    compiler ``mc``, logging to ``tlog`` under ``context``, measuring with ``measurer``
    (:mod:`edgetvm.tune.measure`; default: in this process)."""

    def __init__(self, mc, tasks, tlog, context, *, seed: int = 0, batch: int = 8,
                 measurer=None, alpha: float = 0.2, window: int = 3,
                 use_model: bool = True, progress: bool = True, desc: str = "tuning"):
        if not tasks:
            raise TuneError("nothing to tune: the selected phase programs have no kernel "
                            "with knobs")
        self.mc, self.log, self.ctx = mc, tlog, context
        self.states = [TaskState(t) for t in tasks]
        self.rng = random.Random(seed)
        self.batch, self.alpha, self.window = int(batch), alpha, window
        self.model = CostModel(seed) if use_model else None
        self.measurer = measurer or LocalMeasurer(mc, context.profile)
        self.profile = mc.spec.profile(context.profile)
        self.budget_mw = self.profile.budget_mw
        self.progress, self.desc = progress, desc
        self.measured_now = 0                     # measurements made by this run
        self._resume()

    # -- resume ----------------------------------------------------------------------------
    def _resume(self) -> None:
        by_w = {s.task.workload: s for s in self.states}
        # a trial that failed for want of a server (all gone, the wrong key) says nothing
        # of its candidate: a resumed tune measures it again
        recs = [r for r in self.log.matching(self.ctx) if r.workload in by_w
                and r.neighbours == by_w[r.workload].task.context
                and not _no_server(r)]
        for r in recs:
            by_w[r.workload].offer(r)
        for s in self.states:
            d = canonical_knobs(s.task.default_knobs)
            for r in recs:
                if r.workload == s.task.workload and r.status in (OK, OVER_BUDGET) \
                        and r.knobs_key == d:
                    s.default_cycles = r.cycles
                    s.default_peak_mw = r.peak_power_mw
                    s.default_over = (r.error or "").startswith(DEFAULTS_OVER)
            if s.default_cycles:
                s.history.append(s.best_cycles or s.default_cycles)
        self._train_from(recs)
        if recs:
            log.info("resumed %d records of %d tasks from %s", len(recs),
                     len({r.workload for r in recs}), self.log.path)
        # the best knobs found beside other neighbours, or by an earlier edgetvm or
        # emulator model: a neighbour that changed (another template revision beside it,
        # other cuts) or a new version does not send the search back to the defaults;
        # the cycles of another context are not compared with this one's (its knobs are
        # measured again here)
        others: dict = {}
        for r in self.log.same_build(self.ctx):
            s = by_w.get(r.workload)
            if s is not None and r.status == OK and \
                    (r.neighbours != s.task.context or r.context != self.ctx):
                others.setdefault(r.workload, {}).setdefault(
                    (r.context, r.neighbours), []).append(r)
        for w, by_ctx in others.items():
            s = by_w[w]
            keys = set(s.seen)
            for rs in sorted(by_ctx.values(), key=lambda rs: -max(r.time for r in rs)):
                rs = sorted(rs, key=lambda r: (r.cycles, r.knobs_key))
                taken = 0
                for r in rs:
                    if taken == CARRIED:
                        break
                    if r.knobs_key not in keys:
                        keys.add(r.knobs_key)
                        s.carried.append(r.knobs)
                        taken += 1

    def _train_from(self, recs) -> None:
        if self.model is None:
            return
        by_w = {s.task.workload: s for s in self.states}
        for r in recs:
            s = by_w.get(r.workload)
            if s is not None and s.default_cycles and _teaches(r):
                self.model.add(features(s.task, r.knobs, self.mc.spec, self.profile),
                               r.cycles, s.default_cycles)

    def learn(self, task, records) -> int:
        """Train the cost model on the measurements of another task (``records`` of
        ``task``, its defaults' among them), before this run measures anything: what the
        model one tune shares across its tasks knows when the scheduler reaches a task
        (the same MLP at another bucket, the cuts of another run). Returns how many
        records it learned from (0: no baseline among them)."""
        if self.model is None:
            return 0
        d = canonical_knobs(task.default_knobs)
        base = next((r.cycles for r in records if r.status == OK and r.knobs_key == d
                     and r.cycles), None)
        if not base:
            return 0
        used = [r for r in records if _teaches(r)]
        for r in used:
            self.model.add(features(task, r.knobs, self.mc.spec, self.profile), r.cycles, base)
        self.model.fit()
        return len(used)

    # -- measuring -------------------------------------------------------------------------
    def _record(self, task, knobs, status, *, m=None, error=None, wall_s=0.0,
                cycles=None) -> Record:
        rec = Record(self.ctx, task.workload, task.kind, task.name, knobs, status,
                     cycles=m.cycles if m else cycles, error=error,
                     dram_bytes=m.dram_bytes if m else None,
                     peak_power_mw=round(m.peak_power_mw, 3) if m else None, wall_s=wall_s,
                     neighbours=task.context)
        self.log.append(rec)
        if status != REJECTED:
            self.measured_now += 1
        return rec

    def power_limit(self, state) -> float:
        """The peak power a candidate of ``state``'s task may reach: the budget, or the
        defaults' peak when the defaults break the budget themselves."""
        if state.default_over and state.default_peak_mw:
            return max(self.budget_mw, state.default_peak_mw)
        return self.budget_mw

    def _measure_batch(self, state, batch: list, deadline: float | None = None) -> list:
        """Records of ``batch`` (knob sets of one task, not its defaults: see
        :meth:`_baselines`); each is in the log before this returns. A candidate stops at
        :data:`SLOW` x the task's best. With a ``deadline`` (a ``time.time()``) the batch
        goes out as many at a time as the measurer runs at once, and no candidate starts
        after it (the rest are not tried)."""
        ref = state.best_cycles or state.default_cycles
        slow_after = None if not ref else int(SLOW * ref)
        if deadline is None:
            return self._records(state, batch, False, self.measurer.measure(
                state.task, batch, slow_after=slow_after))
        out: list = []
        par = max(1, self.measurer.workers)
        for i in range(0, len(batch), par):
            if out and time.time() >= deadline:
                break
            part = batch[i:i + par]
            out += self._records(state, part, False, self.measurer.measure(
                state.task, part, slow_after=slow_after))
        return out

    def _records(self, state, batch: list, default: bool, results: list) -> list:
        """Log the measurer's ``results`` of ``batch``; ``default``: they are the task's
        defaults (the baseline: always usable, its peak the task's power limit when over
        the budget)."""
        out = []
        for kn, (res, wall) in zip(batch, results):
            if isinstance(res, TooSlow):
                # a lower bound: failed, but the cost model learns that it is slow
                out.append(self._record(state.task, kn, FAILED, wall_s=wall,
                                        error=str(res), cycles=res.cycles))
            elif isinstance(res, CandidateRejected):
                out.append(self._record(state.task, kn, REJECTED, error=str(res)[:500],
                                        wall_s=wall))
            elif isinstance(res, BaseException):
                out.append(self._record(state.task, kn, FAILED, wall_s=wall,
                                        error=f"{type(res).__name__}: {str(res)[:400]}"))
            elif default and res.over_budget(self.budget_mw):
                # the baseline is always usable; its peak becomes the task's limit
                state.default_over = True
                out.append(self._record(
                    state.task, kn, OK, m=res, wall_s=wall,
                    error=f"{DEFAULTS_OVER}: they peak at {res.peak_power_mw:.0f} mW, over "
                          f"the {self.ctx.profile} budget of {self.budget_mw:.0f} mW"))
            elif not default and res.over_budget(self.power_limit(state)):
                out.append(self._record(
                    state.task, kn, OVER_BUDGET, m=res, wall_s=wall,
                    error=f"peak {res.peak_power_mw:.0f} mW over the limit of "
                          f"{self.power_limit(state):.0f} mW ({self.ctx.profile} budget "
                          f"{self.budget_mw:.0f} mW)"))
            else:
                out.append(self._record(state.task, kn, OK, m=res, wall_s=wall))
        return out

    # -- the loop --------------------------------------------------------------------------
    def _baselines(self, states: list) -> None:
        """Measure the default knobs of ``states`` (as many tasks at once as the measurer
        runs); a task whose defaults do not measure is left out of the search."""
        results = self.measurer.measure_many([(s.task, s.task.default_knobs)
                                              for s in states])
        recs = []
        for s, res in zip(states, results):
            (rec,) = self._records(s, [s.task.default_knobs], True, [res])
            s.offer(rec)
            s.default_peak_mw = rec.peak_power_mw
            if rec.status not in (OK, OVER_BUDGET):
                log.warning("task %s: the default knobs do not measure (%s); skipped",
                            s.task.name, rec.error)
                s.exhausted = True
                continue
            s.default_cycles = rec.cycles
            s.history.append(s.best_cycles or s.default_cycles)
            recs.append(rec)
        self._train_from(recs)

    def _next_baselines(self, first, trials: int | None) -> list:
        """``first`` and, to fill the measurer's workers, the next tasks without a
        baseline, the heaviest (estimated) first."""
        par = max(1, self.measurer.workers) if self.measurer.tasks_at_once else 1
        if trials is not None:
            par = max(1, min(par, trials - self.measured_now))
        rate = self._cycles_per_byte()
        totals = self.program_defaults(rate)
        rest = sorted((s for s in self.states if s is not first and not s.exhausted
                       and s.default_cycles is None),
                      key=lambda s: (-self.weight(s, totals) *
                                     self.estimated_cycles(s, rate), s.task.key))
        return [first] + rest[:par - 1]

    def weight(self, s, totals: dict | None = None) -> float:
        """Sum over the programs ``s``'s task runs in of its occurrences there over the
        program's default cycles (``totals``, :meth:`program_defaults`): a cycle saved
        counts as the share of its program's latency it is."""
        totals = self.program_defaults() if totals is None else totals
        return sum(n / totals[p] for p, n in s.task.per_program.items() if totals.get(p))

    def program_defaults(self, rate: dict | None = None) -> dict:
        """Program name -> its default cycles: its tasks' defaults (occurrences x cycles),
        estimated where not yet measured (:meth:`estimated_cycles`, at ``rate``)."""
        rate = self._cycles_per_byte() if rate is None else rate
        totals: dict = {}
        for o in self.states:
            c = o.default_cycles or self.estimated_cycles(o, rate)
            for p, n in o.task.per_program.items():
                totals[p] = totals.get(p, 0.0) + n * c
        return totals

    def _cycles_per_byte(self) -> dict:
        """Kind -> the median default cycles per byte of size hint of the measured tasks
        (key None: of every kind)."""
        rates: dict = {}
        for o in self.states:
            if o.default_cycles and o.task.size_hint:
                rates.setdefault(o.task.kind, []).append(o.default_cycles / o.task.size_hint)
        out = {k: float(np.median(v)) for k, v in rates.items()}
        out[None] = float(np.median([r for v in rates.values() for r in v])) if rates else 1.0
        return out

    def estimated_cycles(self, s, rate: dict | None = None) -> float:
        """The task's cycles: its best or default if measured, else its
        :attr:`~edgetvm.tune.tasks.Task.size_hint` at the median cycles per byte of the
        measured tasks of its kind (of any kind when none is measured yet; ``rate``:
        :meth:`_cycles_per_byte`, computed once for many calls)."""
        if s.best_cycles or s.default_cycles:
            return s.best_cycles or s.default_cycles
        rate = self._cycles_per_byte() if rate is None else rate
        return rate.get(s.task.kind, rate[None]) * max(1, s.task.size_hint)

    def step_cycles(self) -> int:
        """Sum over the tasks of (occurrences x the cycles of the knobs a build replays:
        the best within the budget, else the defaults)."""
        return sum(s.task.count * (s.best_cycles or s.default_cycles or 0)
                   for s in self.states)

    def progress_text(self) -> str:
        """The best so far per phase, as the progress bar shows it: the summed cycles of
        the phase's programs (occurrences x the best cycles of each task) and the gain
        over the defaults, e.g. ``decode 2.1M cyc 1.04x | prefill 7.9M cyc 1.09x``."""
        parts = []
        for ph in sorted({p for s in self.states for p in s.task.per_phase}):
            cur = base = 0
            for s in self.states:
                n = s.task.per_phase.get(ph, 0)
                if n and s.default_cycles:
                    cur += n * (s.best_cycles or s.default_cycles)
                    base += n * s.default_cycles
            if base:
                parts.append(f"{ph} {cur / 1e6:.2f}M cyc {base / cur:.3f}x")
        return " | ".join(parts)

    def default_step_cycles(self) -> int:
        return sum(s.task.count * (s.default_cycles or 0) for s in self.states)

    def _pick(self, timed: bool = False):
        """The task to tune next: the largest gradient (see the module's docstring), per
        second of its mean trial time when ``timed``; None when every space is
        exhausted."""
        live = [s for s in self.states if not s.exhausted]
        if not live:
            return None
        rate = self._cycles_per_byte()
        totals = self.program_defaults(rate)
        # a task whose pool the model guides (a run's cuts) has one round before any task
        # has a second: its prior ranks near-best cut sets first, so that round gains more
        # than later ones elsewhere, however long its candidates take (a 512-row run's
        # seconds per trial otherwise kept it waiting past a short budget)
        first = [s for s in live if s.task.kind in GUIDED_KINDS and len(s.history) <= 1]
        if first:
            return max(first, key=lambda s: (self.weight(s, totals) *
                                             self.estimated_cycles(s, rate), s.task.key))
        walls = [s.wall_s / s.walls for s in self.states if s.walls]
        typical = float(np.median(walls)) if walls else 1.0

        def grad(s):
            h = s.history
            forward = self.estimated_cycles(s, rate) / (s.trials + 1)
            g = forward
            if len(h) >= 2:
                w = min(self.window, len(h) - 1)
                g = self.alpha * (h[-1 - w] - h[-1]) / w + (1 - self.alpha) * forward
            g *= self.weight(s, totals)
            if timed:
                g /= max(1e-3, s.wall_s / s.walls if s.walls else typical)
            return g
        return max(live, key=lambda s: (grad(s), s.task.key))

    def _propose(self, s, n: int) -> list:
        t = s.task
        # the task's seeds first (up to half the batch): the best knobs of other measuring
        # contexts, then the template's own; then the model's picks
        carried = [p for p in map(t.to_point, s.carried) if p is not None]
        seeds, keys = [], set()
        for p in self._affordable(t, carried + t.seeds()):
            k = canonical_knobs(t.to_knobs(p))
            if k not in s.seen and k not in keys and len(seeds) < max(1, n // 2):
                keys.add(k)
                seeds.append(p)
        n -= len(seeds)
        pool = [p for p in self._affordable(t, t.sample(self.rng, max(64, 8 * n), s.seen))
                if canonical_knobs(t.to_knobs(p)) not in keys]
        keys |= {canonical_knobs(t.to_knobs(p)) for p in pool}

        def grow(points):
            for p in self._affordable(t, points):
                k = canonical_knobs(t.to_knobs(p))
                if k not in s.seen and k not in keys:
                    keys.add(k)
                    pool.append(p)
        best_point = t.to_point(s.best_knobs or t.default_knobs)
        if best_point is not None:
            near = t.neighbours(best_point)
            grow(near)
            if len(t.space.get("list_schedule", ())) > 1:
                # the order decides which tiles pay off (row tiles pipeline only when
                # list-scheduled): the best's neighbours in the other order as well
                grow([{**p, "list_schedule": 1 - int(p["list_schedule"] or 0)}
                      for p in near])
        if not pool or n <= 0:
            return [t.to_knobs(p) for p in seeds]
        self.rng.shuffle(pool)
        if self.model is not None and len(pool) > n:
            # ranked by the model, or by its analytic prior before it has data (a task
            # without a prior, an embedding, keeps the shuffled order: the ranking is stable)
            X = np.stack([features(t, t.to_knobs(p), self.mc.spec, self.profile)
                          for p in pool])
            for _ in range(GUIDED_GENERATIONS if t.kind in GUIDED_KINDS else 0):
                # model-guided mutation: the neighbours of the points it ranks highest
                # join the pool (the pool's random points rarely hold the best region)
                size = len(pool)
                for i in self.model.rank(X)[:4]:
                    grow(t.neighbours(pool[i]))
                if len(pool) == size:
                    break
                X = np.concatenate([X, np.stack([features(t, t.to_knobs(p), self.mc.spec,
                                                          self.profile)
                                                 for p in pool[size:]])])
            order = list(self.model.rank(X))
            explore = max(1, n // 4)
            chosen = order[:n - explore]
            rest = order[n - explore:]
            chosen += self.rng.sample(rest, min(explore, len(rest)))
            pool = [pool[i] for i in chosen]
        return [t.to_knobs(p) for p in seeds + pool[:n]]

    @staticmethod
    def _affordable(t, points: list) -> list:
        """``points`` whose tile operations are at most :data:`MAX_TILE_OPS` x the
        defaults' (a prefill-512 attention at 8x16 tiles issues 27x the default's 19,000
        commands: 3 minutes to lower, 4 to emulate, 7x slower)."""
        cap = MAX_TILE_OPS * max(1, t.tile_ops(t.default_knobs))
        return [p for p in points if t.tile_ops(t.to_knobs(p)) <= cap]

    def _program_mean(self, term) -> float:
        """The mean over the selected programs of the share of their default latency that
        ``term(state, rate)`` cycles are (None: the task does not count)."""
        rate = self._cycles_per_byte()
        totals = self.program_defaults(rate)
        if not totals:
            return 0.0
        return sum(self.weight(s, totals) * c for s in self.states
                   if (c := term(s, rate)) is not None) / len(totals)

    def gain(self) -> float:
        """What tuning gained so far: the mean over the selected programs of the share of
        their default latency saved (occurrences x (default - best cycles) of their
        measured tasks, over the program's default cycles)."""
        return self._program_mean(
            lambda s, _: s.default_cycles - s.best_cycles
            if s.default_cycles and s.best_cycles else None)

    def unreached_share(self) -> float:
        """The mean over the selected programs of the share of their default latency in
        tasks without a baseline yet (estimated, :meth:`estimated_cycles`)."""
        return self._program_mean(
            lambda s, rate: self.estimated_cycles(s, rate)
            if s.default_cycles is None and not s.exhausted else None)

    def run(self, trials: int | None = None, time_budget: float | None = None,
            stall: int | None = None) -> dict:
        """Tune until ``trials`` measurements were made by this run (rejected candidates do
        not count) or ``time_budget`` seconds passed, or every space is exhausted, or with
        ``stall``, the search stalls: the last ``stall`` searched candidates or more
        gained too little (:data:`STALL_GAIN`) and the tasks it has not reached yet are
        light (:data:`STALL_UNREACHED`; the report's ``stalled``)."""
        if trials is None and time_budget is None:
            raise TuneError("give a budget: trials or a time budget")
        t_start = time.time()
        deadline = None if time_budget is None else t_start + time_budget
        bar = _bar(trials, self.progress, self.desc)
        searched = 0                           # measurements of searched candidates
        gains = [(0, self.gain())] if stall else []   # (searched, gain) after each batch
        stalled = False
        try:
            while True:
                if trials is not None and self.measured_now >= trials:
                    break
                if deadline is not None and time.time() >= deadline:
                    break
                if stall and self._stalled(gains, searched, stall) and \
                        self.unreached_share() < STALL_UNREACHED:
                    stalled = True
                    break
                s = self._pick(timed=deadline is not None)
                if s is None:
                    break
                before = self.measured_now
                if s.default_cycles is None:
                    self._baselines(self._next_baselines(s, trials))
                    bar.update(self.measured_now - before)
                    continue
                n = self.batch if trials is None else min(self.batch,
                                                          trials - self.measured_now)
                if deadline is not None and s.walls:
                    # no batch that would end well past the budget: as many candidates as
                    # this task's mean trial time leaves room for (at least one)
                    left = deadline - time.time()
                    par = self.measurer.workers                   # candidates at once
                    n = min(n, par * (int(left / max(1e-3, s.wall_s / s.walls)) + 1))
                batch = self._propose(s, max(1, n))
                if not batch:
                    s.exhausted = True
                    continue
                recs = self._measure_batch(s, batch, deadline=deadline)
                interrupt.check()                # a Ctrl-C that TVM turned into an error
                for r in recs:
                    s.offer(r)
                self._train_from(recs)
                if self.model is not None:
                    self.model.fit()
                s.history.append(s.best_cycles or s.default_cycles)
                searched += self.measured_now - before
                if stall:
                    gains.append((searched, self.gain()))
                bar.update(self.measured_now - before)
                bar.set_postfix_str(self.progress_text())
        finally:
            bar.close()
        unmeasured = sum(1 for s in self.states if s.default_cycles is None
                         and not s.exhausted)
        if unmeasured:
            log.info("the budget reached %d of %d tasks; the other %d keep their default "
                     "knobs", len(self.states) - unmeasured, len(self.states), unmeasured)
        return dict(self.report(time.time() - t_start), stalled=stalled)

    @staticmethod
    def _stalled(gains: list, n: int, stall: int) -> bool:
        """Did the last ``max(stall, n / 4)`` of the ``n`` searched candidates (baselines
        are not searched: they gain nothing) raise the gain by less than
        :data:`STALL_GAIN`? (:meth:`run` also asks that the tasks without a baseline
        are light: a stage that has not reached its heavy kernels is not done.)"""
        window = max(stall, n // 4)
        if n < window:
            return False
        then = [g for m, g in gains if m <= n - window][-1]
        return gains[-1][1] - then < STALL_GAIN

    def report(self, seconds: float) -> dict:
        rows = []
        for s in self.states:
            t = s.task
            rows.append(dict(task=t.label, kind=t.kind, workload=t.workload[:12],
                             context=t.context,
                             count=t.count, phases=sorted(t.phases),
                             default_cycles=s.default_cycles, best_cycles=s.best_cycles,
                             # a resumed task may have records but no measurement of
                             # today's default knobs yet (defaults changed since)
                             speedup=(s.default_cycles / s.best_cycles)
                             if s.best_cycles and s.default_cycles else None,
                             trials=s.trials, rejected=s.rejected, failed=s.failed,
                             first_error=s.first_error,
                             over_budget=s.over_budget,
                             space=t.space_size, best_knobs=s.best_knobs,
                             default_knobs=t.default_knobs))
        return dict(stage=self.desc, tasks=rows, measured=self.measured_now, seconds=seconds,
                    step_cycles_default=self.default_step_cycles(),
                    step_cycles_tuned=self.step_cycles(), log=self.log.path)


def _no_server(r) -> bool:
    """Did trial ``r`` fail because no emulator server answered (not because of its
    candidate)?"""
    from edgetvm.runner.base import RunnerConnectionError
    # a failed record's error is "<exception type>: <message>" (Tuner._records)
    return r.status == FAILED and (r.error or "").startswith(RunnerConnectionError.__name__)


def _teaches(r) -> bool:
    """Does record ``r`` carry cycles the cost model may learn from: measured (within the
    budget or not), or stopped as too slow (a lower bound)?"""
    return bool(r.cycles) and (r.status in (OK, OVER_BUDGET) or
                               (r.error or "").startswith(STOPPED))


def _bar(total, on: bool, desc: str = "tuning"):
    from tqdm import tqdm
    return tqdm(total=total, unit="trial", file=sys.stderr, desc=desc, disable=not on)


def format_report(rep: dict) -> str:
    lines = [f"{'task':<44} {'runs':>4} {'default_cyc':>11} {'best_cyc':>11} "
             f"{'x':>5} {'trials':>6} {'rej':>4} {'fail':>4} {'over':>4}"]
    for r in sorted(rep["tasks"], key=lambda r: -(r["count"] * (r["default_cycles"] or 0))):
        sp = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        lines.append(f"{r['task'][:44]:<44} {r['count']:>4} "
                     f"{r['default_cycles'] or 0:>11,} {r['best_cycles'] or 0:>11,} {sp:>5} "
                     f"{r['trials']:>6} {r['rejected']:>4} {r['failed']:>4} "
                     f"{r.get('over_budget', 0):>4}")
    for st in rep.get("stages") or [dict(rep, stage="tuning")]:
        d, b = st["step_cycles_default"], st["step_cycles_tuned"]
        what = "runs of fusable ops" if st["stage"].startswith("cuts") else "kernels"
        lines.append(f"{st['stage']}: sum over the {what} of the selected programs (runs x "
                     f"cycles): {d:,} -> {b:,} cycles ({d / b:.3f}x), {st['measured']} "
                     f"measurements in {st['seconds']:.1f} s" if b else
                     f"{st['stage']}: nothing measured")
    lines.append(f"{rep['measured']} measurements in {rep['seconds']:.1f} s; log {rep['log']}")
    if rep.get("note"):
        lines.append(rep["note"])
    if rep.get("phases"):
        lines.append(f"{'whole program (linked, prefetch)':<34} {'default_cyc':>11} "
                     f"{'tuned_cyc':>11} {'x':>6} {'kernels':>9} {'peak_mW':>8} {'tuned':>8} "
                     f"(budget {rep['budget_mw']:.0f})")
        for r in rep["phases"]:
            ks = f"{r.get('default_kernels', '?')}->{r.get('tuned_kernels', '?')}"
            lines.append(f"{r['program']:<34} {r['default_cycles']:>11,} "
                         f"{r['tuned_cycles']:>11,} "
                         f"{r['default_cycles'] / r['tuned_cycles']:>6.3f} {ks:>9} "
                         f"{r['default_peak_mw']:>8.0f} {r['tuned_peak_mw']:>8.0f}")
        for r in rep["phases"]:
            if r.get("prefetch") == AT_END:
                build = r.get("replayed", TUNED)
                spread = r["default_cycles" if build == DEFAULTS else "tuned_cycles"]
                lines.append(
                    f"note: {r['program']}: with each prefetch at the end of the kernel "
                    f"before, the {build} program measured {r[build + '_at_end_cycles']:,} "
                    f"cycles against {spread:,} spread under compute-bound kernels: a "
                    f"build with --log links it so")
            if r.get("replayed") != DEFAULTS:
                continue
            fastest = min(r[k] for k in ("tuned_cycles", "tuned_at_end_cycles") if k in r)
            defaults = r["defaults_at_end_cycles" if r.get("prefetch") == AT_END
                         else "default_cycles"]
            why = (f"{fastest / defaults - 1:.1%} slower than"
                   if fastest > defaults else
                   f"over the budget at the floor clock ({r['tuned_peak_mw']:.0f} mW), "
                   f"above")
            lines.append(
                f"note: {r['program']}: the tuned program is {why} the defaults as a "
                f"whole (its kernels were measured beside their neighbours, not across the "
                f"step, whose power windows and clock span kernels): a build with --log "
                f"builds this program with the defaults")
    return "\n".join(lines)
