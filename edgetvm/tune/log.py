"""The tuning log: append-only JSON lines, one record per tried candidate, crash-safe.

A log is a directory (default ``tuning_logs/``) holding ``records.jsonl``. Every record is
one line, written by a single ``os.write`` on an ``O_APPEND`` descriptor and ``fsync``'d
before the tuner moves on, so

* a record is in the log as soon as it is measured (a kill loses at most the candidate
  being measured);
* two tuners appending to one log interleave whole lines and lose nothing (``O_APPEND``
  writes of a regular file land at the end atomically on local file systems);
* a line torn by a crash mid-write is skipped with a warning on load, never aborts it
  (MetaSchedule's ``JSONDatabase`` raises on the first bad line, apache/tvm #15549), and
  the next writer first ends the torn line, so its own records stay whole.

A record (``Record``) is keyed by its **context**, :class:`LogContext` (the model file's
hash, the NPU spec hash, power profile, quantization, edgetvm version and emulator model
version) and its **workload** (the SHA-256 of the kernel's structural key,
:attr:`~edgetvm.build.kernels.Kernel.key`), and holds the knobs, the measured cycles (or
the error of a failed trial, or the reason a candidate was rejected before measuring),
its DRAM bytes, peak power and the wall time the trial took. Lookups filter on the whole
context (MetaSchedule's database ignores the target on lookup, apache/tvm #7725).

Why not MetaSchedule's ``Database`` (a ``PyDatabase`` subclass): its unit is a
``TuningRecord`` = an s_tir ``Trace`` replayed onto a ``Workload`` IRModule, with run
seconds and a ``Target``. The NPU's records do not fit that: the attention and embedding
templates are written with explicit tile loops (``TileKernel``), not traced sampling
decisions, so they have no trace to replay; the keys a record must carry (power profile,
quantization, emulator model version, the outcome of a failed or rejected trial) have no
place in a ``TuningRecord``; and a ``Workload`` is looked up by IRModule structural
equality where our workloads are identified by the kernel key the linker already uses.
Knobs are the replayable part here: :class:`~edgetvm.build.kernels.KernelBuilder` lowers a
kernel from them (``knobs_for``), on the same path as the default build.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field

from edgetvm.errors import EdgeTVMError

log = logging.getLogger("edgetvm")

#: (log file, line number, bytes) of the unreadable lines already warned about in this process:
#: each is said once, however often the log is read
_WARNED: set = set()

LOG_FILE = "records.jsonl"
DEFAULT_LOG_DIR = "tuning_logs"
#: 2: records carry ``neighbours`` (measured in context); 1 (kernels measured alone)
#: still loads, as records of the context ``""``
FORMAT_VERSION = 2

#: the keys of a context, in the order a mismatch is reported
CONTEXT_KEYS = ("model", "spec", "profile", "quantization", "edgetvm", "emulator")
#: the keys that say which kernels a record's knobs build (not which code measured them)
VERSION_FREE_KEYS = ("model", "spec", "profile", "quantization")

#: measured and usable; not measured (does not lower: TCM overflow); measuring failed;
#: measured, but puts the step over the power profile's budget (never chosen)
OK, REJECTED, FAILED, OVER_BUDGET = "ok", "rejected", "failed", "over_budget"

#: the kind of a record whose knobs are the cuts of a run of fusable ops, ``{"cuts": [..]}``
PARTITION = "partition"
#: the kind of a record that measured a whole phase program (``name``: e.g.
#: ``decode_1x64p``; ``workload``: :func:`program_workload` of it and the compiler's
#: ``build_identity``) as a replay of the log builds it (``knobs``: ``{"selection": the
#: replay's :attr:`Replay.selection`, "build": "tuned", **identity}``) or with the
#: defaults (``"build": "defaults"``: the strategy's partition, default knobs); written
#: by ``edgetvm.tune`` at its end, read by :meth:`Replay.builds_defaults`
PROGRAM = "program"
TUNED, DEFAULTS = "tuned", "defaults"
#: where a program record's cross-kernel prefetches went (``knobs["prefetch"]``; records
#: without it: spread): blocks spread under a compute-bound kernel where the linker's
#: estimate says so, or each at the end of the kernel before
#: (:class:`~edgetvm.build.link.Linker`)
SPREAD, AT_END = "spread", "end"


class TuningLogError(EdgeTVMError):
    """A tuning log cannot be used: unreadable, or its records are for another context."""


def workload_hash(kernel_key: str) -> str:
    """The workload's structural hash: SHA-256 of the kernel's structural key."""
    return hashlib.sha256(kernel_key.encode()).hexdigest()


def program_workload(name: str, identity: dict) -> str:
    """The workload hash of the whole phase program ``name`` of a compiler whose
    ``build_identity()`` is ``identity`` (strategy, KV capacity, largest bucket):
    :data:`PROGRAM` records."""
    return workload_hash(f"program:{name}:{canonical_knobs(identity)}")


def canonical_knobs(knobs: dict) -> str:
    return json.dumps(knobs, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class LogContext:
    """What a measurement depends on besides the workload and its knobs."""

    model: str             # SHA-256 of the ONNX file
    spec: str              # NPUSpec.hash()
    profile: str           # power profile name
    quantization: str      # canonical JSON of the quantization, "none" for fp16
    edgetvm: str           # edgetvm.__version__
    emulator: int          # target.spec.EMULATOR_MODEL_VERSION

    @classmethod
    def current(cls, model_sha256: str, spec, profile: str, quantization) -> "LogContext":
        import edgetvm
        from edgetvm.target.spec import EMULATOR_MODEL_VERSION
        q = "none" if not quantization else json.dumps(quantization, sort_keys=True)
        return cls(model_sha256, spec.hash(), spec.profile(profile).name, q,
                   edgetvm.__version__, int(EMULATOR_MODEL_VERSION))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def same_build(self, other: "LogContext") -> bool:
        """Is ``other`` this context but for the versions (edgetvm, emulator model)? Its
        knobs build the same kernels; its cycles were measured under another model."""
        return all(getattr(self, k) == getattr(other, k) for k in VERSION_FREE_KEYS)


def log_context(onnx_path: str, spec, profile, quantize) -> LogContext:
    """The :class:`LogContext` of a build of ``onnx_path`` for ``spec`` under ``profile``
    (None: the spec's default) with ``quantize`` (None: fp16)."""
    from edgetvm.build.fingerprint import describe_quantize, model_sha256
    return LogContext.current(model_sha256(onnx_path), spec, profile,
                              describe_quantize(quantize))


@dataclass
class Record:
    """One tried candidate."""

    context: LogContext
    workload: str                # workload_hash(kernel key)
    kind: str                    # the template: cluster, decode_attention, embedding, ...
    name: str                    # the kernel's name (for people)
    knobs: dict
    status: str                  # ok | rejected | failed | over_budget
    cycles: int | None = None
    error: str | None = None
    dram_bytes: int | None = None
    peak_power_mw: float | None = None
    wall_s: float = 0.0
    time: float = field(default_factory=time.time)
    neighbours: str = ""         # the measuring context (Task.context); "" = alone

    @property
    def knobs_key(self) -> str:
        return canonical_knobs(self.knobs)

    def to_json(self) -> str:
        d = {"v": FORMAT_VERSION, **self.context.as_dict(), "workload": self.workload,
             "kind": self.kind, "name": self.name, "knobs": self.knobs,
             "status": self.status, "cycles": self.cycles, "error": self.error,
             "dram_bytes": self.dram_bytes, "peak_power_mw": self.peak_power_mw,
             "wall_s": round(self.wall_s, 6), "time": round(self.time, 3),
             "neighbours": self.neighbours}
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        if not isinstance(d, dict):
            raise ValueError(f"a record is a JSON object, not {type(d).__name__}")
        if d.get("v") not in (1, FORMAT_VERSION):
            raise ValueError(f"format version {d.get('v')!r}")
        ctx = LogContext(**{k: d[k] for k in CONTEXT_KEYS})
        status = d["status"]
        if status not in (OK, REJECTED, FAILED, OVER_BUDGET):
            raise ValueError(f"status {status!r}")
        cycles = d.get("cycles")
        if status in (OK, OVER_BUDGET) and not (isinstance(cycles, int) and cycles > 0):
            raise ValueError(f"a measured record without cycles ({cycles!r})")
        if not isinstance(d["knobs"], dict):
            raise ValueError("knobs are not an object")
        if d["kind"] == "partition" and status == OK:
            cuts = d["knobs"].get("cuts")
            if not isinstance(cuts, list) or not all(
                    isinstance(c, int) and not isinstance(c, bool) for c in cuts):
                raise ValueError(f"a partition record whose cuts are not a list of "
                                 f"integers ({cuts!r})")
        return cls(ctx, str(d["workload"]), str(d["kind"]), str(d["name"]), d["knobs"],
                   status, cycles, d.get("error"), d.get("dram_bytes"),
                   d.get("peak_power_mw"), float(d.get("wall_s", 0.0)),
                   float(d.get("time", 0.0)), str(d.get("neighbours", "")))


class TuningLog:
    """A log directory: append records, load them, look up the best per workload."""

    def __init__(self, directory: str = DEFAULT_LOG_DIR, create: bool = True):
        self.dir = directory
        self.path = os.path.join(directory, LOG_FILE)
        if not os.path.isdir(directory):
            if os.path.exists(directory):
                raise TuningLogError(f"{directory}: not a directory (a tuning log is a "
                                     f"directory holding {LOG_FILE})")
            if not create:
                raise TuningLogError(f"{directory}: no such tuning log directory")
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as e:
                raise TuningLogError(f"{directory}: cannot create the tuning log "
                                     f"directory: {e.strerror}") from None
        if create and not (os.access(directory, os.W_OK | os.X_OK) and (
                not os.path.exists(self.path) or os.access(self.path, os.W_OK))):
            # refused now, not after the first candidate was measured
            raise TuningLogError(f"{self.path}: the tuning log is not writable")
        self._fd: int | None = None
        self.skipped = 0                 # unreadable lines of the last load

    # -- writing ---------------------------------------------------------------------------
    def _open(self) -> int:
        if self._fd is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            # a crash mid-write left a line without its newline: end it first, so this
            # writer's records are whole lines (the torn one is skipped on load). Racing
            # writers may both add one: an empty line, which loads as nothing.
            if os.fstat(fd).st_size:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        os.write(fd, b"\n")
            self._fd = fd
        return self._fd

    def append(self, record: Record) -> None:
        """Write one record as one line, durably, before returning."""
        line = (record.to_json() + "\n").encode()
        fd = self._open()
        n = os.write(fd, line)
        if n != len(line):               # a full disk; never leave half a record behind
            raise TuningLogError(f"{self.path}: short write ({n} of {len(line)} bytes)")
        os.fsync(fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- reading ---------------------------------------------------------------------------
    def records(self) -> list:
        """Every readable record in file order; unreadable lines (a torn last line after a
        kill, a damaged one) are skipped with a warning."""
        self.skipped = 0
        if not os.path.exists(self.path):
            return []
        out = []
        with open(self.path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        for no, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                out.append(Record.from_dict(json.loads(raw)))
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
                self.skipped += 1
                key = (os.path.abspath(self.path), no, raw)
                if key in _WARNED:            # a tune and its build read the log again
                    continue
                _WARNED.add(key)
                torn = no == len(lines) and not data.endswith(b"\n")
                log.warning("%s line %d: %s record skipped (%s)", self.path, no,
                            "torn" if torn else "unreadable", str(e)[:120])
        return out

    def trials(self) -> list:
        """The records of tried candidates: every record but the whole programs'
        measurements (:data:`PROGRAM`) a tune makes at its end."""
        return [r for r in self.records() if r.kind != PROGRAM]

    def matching(self, context: LogContext) -> list:
        return [r for r in self.records() if r.context == context]

    def same_build(self, context: LogContext) -> list:
        """The records of ``context`` and of its earlier versions (:meth:`LogContext.same_build`)."""
        return [r for r in self.records() if context.same_build(r.context)]

    def check_context(self, context: LogContext, records: list | None = None) -> list:
        """The records of ``context``; a log with records but none of this context is
        refused, naming every key whose value no record has."""
        records = self.records() if records is None else records
        if not records:
            raise TuningLogError(f"{self.path}: no tuning records")
        mine = [r for r in records if r.context == context]
        if mine:
            return mine
        diffs = []
        for k in CONTEXT_KEYS:
            want = getattr(context, k)
            have = sorted({str(getattr(r.context, k)) for r in records})
            if str(want) not in have:
                diffs.append(f"{k} is {want!r} here, the log has {', '.join(map(repr, have))}")
        if not diffs:
            diffs.append("no record matches every key at once (" +
                         ", ".join(f"{k}={getattr(context, k)!r}" for k in CONTEXT_KEYS) + ")")
        raise TuningLogError(f"tuning log {self.dir} does not match this build: " +
                             "; ".join(diffs))

    @staticmethod
    def best(records: list) -> dict:
        """workload -> its best measured Record (fewest cycles; ties broken by the knobs'
        canonical text, so the choice does not depend on the order of the log).

        Cycles measured in different contexts (``neighbours``: another set of tuned
        programs put other kernels beside it) are not compared: per workload the context
        of its latest measurement is used (ties: the smaller name). The latest tuning run
        tuned the kernels of the partition of the log's best cuts, which is the partition
        a replay builds; an earlier run may have tuned them beside other cuts."""
        latest: dict = {}                      # workload -> (time, neighbours)
        for r in records:
            cur = latest.get(r.workload)
            if r.status == OK and (cur is None or r.time > cur[0] or
                                   (r.time == cur[0] and r.neighbours < cur[1])):
                latest[r.workload] = (r.time, r.neighbours)
        chosen = {w: n for w, (_, n) in latest.items()}
        best: dict = {}
        for r in records:
            if r.status != OK or chosen[r.workload] != r.neighbours:
                continue
            cur = best.get(r.workload)
            if cur is None or (r.cycles, r.knobs_key) < (cur.cycles, cur.knobs_key):
                best[r.workload] = r
        return best


class Replay:
    """``knobs_for`` of a :class:`~edgetvm.build.kernels.KernelBuilder` from a log: the best
    logged knobs of each kernel, ``None`` (defaults) for kernels the log does not cover;
    and :meth:`cuts_for`, the best logged cuts of each run of fusable ops (the tuner's
    ``partition`` tasks, :mod:`edgetvm.build.cuts`)."""

    def __init__(self, directory: str, context: LogContext):
        tl = TuningLog(directory, create=False)
        records = tl.check_context(context)
        self.best = TuningLog.best([r for r in records if r.kind != PROGRAM])
        if not self.best:
            raise TuningLogError(f"tuning log {directory}: no successful measurement for "
                                 f"this build's context")
        #: the SHA-256 of the knobs and cuts this replay chooses (every workload's best):
        #: a whole-program measurement applies to this selection only
        self.selection = hashlib.sha256("\n".join(sorted(
            f"{w}:{r.knobs_key}" for w, r in self.best.items())).encode()).hexdigest()
        #: workload (:func:`program_workload`) -> (build, prefetch) of the phase programs
        #: the log measured faster, for this selection, built otherwise than tuned with
        #: their prefetches spread (:func:`best_builds`): :meth:`builds_defaults`,
        #: :meth:`spreads`
        self.builds = best_builds(records, self.selection)
        self.used: dict = {}          # workload -> Record, the kernels replayed

    def __call__(self, kernel_key: str):
        rec = self.best.get(workload_hash(kernel_key))
        if rec is None or rec.kind == PARTITION:
            return None
        self.used[rec.workload] = rec
        return json.loads(json.dumps(rec.knobs))       # a private copy

    @property
    def compiler_options(self) -> dict:
        """The :class:`~edgetvm.build.compiler.ModelCompiler` keywords that replay this
        log: its knobs, its cuts, the programs it builds with the defaults and those it
        links with every prefetch at the end of the kernel before."""
        return dict(knobs_for=self, cuts_for=self.cuts_for, defaults_for=self.builds_defaults,
                    spread_for=self.spreads)

    def builds_defaults(self, name: str, identity: dict) -> bool:
        """Did the log measure program ``name`` of a compiler of ``identity`` (its
        ``build_identity()``) faster with the defaults, for this replay's selection?"""
        return self.build_of(name, identity)[0] == DEFAULTS

    def spreads(self, name: str, identity: dict) -> bool:
        """May program ``name`` of a compiler of ``identity`` spread its prefetches (the
        linker's choice), or did the log measure it faster with each at the end of the
        kernel before?"""
        return self.build_of(name, identity)[1] != AT_END

    def build_of(self, name: str, identity: dict) -> tuple:
        """(build, prefetch) of program ``name`` of a compiler of ``identity`` as the log
        says to build it: tuned and spread unless it measured another build faster."""
        return self.builds.get(program_workload(name, identity), (TUNED, SPREAD))

    def cuts_for(self, run_key: str):
        """The logged best cuts of the run ``run_key`` (None: the log has none)."""
        rec = self.best.get(workload_hash(run_key))
        if rec is None or rec.kind != PARTITION:
            return None
        self.used[rec.workload] = rec
        return [int(p) for p in rec.knobs["cuts"]]

    def summary(self) -> dict:
        """What the artifact's manifest says about the replay (deterministic)."""
        chosen = sorted(f"{w}:{r.knobs_key}:{r.cycles}" for w, r in self.used.items())
        return {"kernels_tuned": sum(r.kind != PARTITION for r in self.used.values()),
                "runs_cut": sum(r.kind == PARTITION for r in self.used.values()),
                "records_sha256": hashlib.sha256("\n".join(chosen).encode()).hexdigest()}


def program_record(context: LogContext, name: str, identity: dict, selection: str,
                   build: str, cycles: int, dram_bytes: int, peak_power_mw: float,
                   over_budget: bool = False, prefetch: str = SPREAD) -> Record:
    """The :data:`PROGRAM` record of phase program ``name`` of a compiler of
    ``identity`` measured whole as replay ``selection`` builds it (``build``:
    :data:`TUNED`) or with the defaults (:data:`DEFAULTS`), its prefetches placed as
    ``prefetch`` says (:data:`SPREAD` or :data:`AT_END`)."""
    if prefetch not in (SPREAD, AT_END):
        raise ValueError(f"prefetch {prefetch!r} is neither {SPREAD!r} nor {AT_END!r}")
    return Record(context, program_workload(name, identity), PROGRAM, name,
                  {"selection": selection, "build": build, "prefetch": prefetch, **identity},
                  OVER_BUDGET if over_budget else OK, int(cycles),
                  dram_bytes=int(dram_bytes), peak_power_mw=round(float(peak_power_mw), 3))


#: the builds of a program, the one a tie goes to first: the tuned one linked as the
#: linker chooses, unless another measured better
_BUILDS = ((TUNED, SPREAD), (TUNED, AT_END), (DEFAULTS, SPREAD), (DEFAULTS, AT_END))


def best_builds(records: list, selection: str) -> dict:
    """workload -> (build, prefetch) of the programs whose latest :data:`PROGRAM` records
    for ``selection`` say a build other than the tuned one with spread prefetches is
    better: of the builds measured, the fastest within the budget (beyond what the
    governor corrects), or the fastest if none is; a tie goes to the earlier of
    :data:`_BUILDS`. A program whose tuned, spread build was not measured is not judged."""
    latest: dict = {}                    # (workload, build, prefetch) -> Record
    for r in records:
        if r.kind != PROGRAM or not isinstance(r.knobs, dict) or \
                r.knobs.get("selection") != selection or r.status not in (OK, OVER_BUDGET):
            continue
        k = (r.workload, r.knobs.get("build"), r.knobs.get("prefetch", SPREAD))
        if k[1:] not in _BUILDS:
            continue
        cur = latest.get(k)
        if cur is None or (r.time, -r.cycles) > (cur.time, -cur.cycles):
            latest[k] = r
    out = {}
    for workload in sorted({w for w, _, _ in latest}):
        measured = [(b, latest[(workload, *b)]) for b in _BUILDS if (workload, *b) in latest]
        if measured[0][0] != _BUILDS[0]:
            continue
        best = min(measured, key=lambda m: (m[1].status != OK, m[1].cycles,
                                            _BUILDS.index(m[0])))[0]
        if best != _BUILDS[0]:
            out[workload] = best
    return out
