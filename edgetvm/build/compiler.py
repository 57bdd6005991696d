"""ModelCompiler: an ONNX LLM to whole-phase NPU programs.

    front end -> LLM semantics -> offload -> per phase and bucket: phase graph ->
    partition -> kernels (lowered once per distinct shape) -> DRAM plan -> link

``program(phase, rows, pages)`` gives the :class:`~edgetvm.target.isa.Program` that runs
one whole forward pass: prefill of a ``rows``-token chunk (the length bucket) or a decode
step, its attention reading up to ``pages`` KV pages (the capacity bucket). Runtime
parameters: ``ids.<i>`` (token ids), ``pos`` (position of the first new token),
``valid_len`` (tokens in the cache after the step), ``n_new`` / ``slot_page.<i>`` /
``slot_offset.<i>`` (where the new K/V go), ``page_table.<i>`` (the sequence's pages) and,
for prefill, ``last_row`` (the row whose logits are returned).
"""
from __future__ import annotations

import functools
import logging
import time
from collections import Counter

import tvm

from edgetvm.frontend import import_onnx
from edgetvm.kv_state import capacity_bucket
from edgetvm.npu_regions import offloadable, unsound_offloads
from edgetvm.offload import offload_regions
from edgetvm.relax_passes import AnnotateLLMSemantics, QuantizeW4A16
from edgetvm.relax_passes.partition import STRATEGIES, partition
from edgetvm.runtime.model import program_name
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules.kv_cache import PAGE_TOKENS, KVCacheLayout

from .cuts import apply_cuts
from .graph import (BuildError, PositionTableError, add_alibi_slopes, add_sliding_windows,
                    extract_phase_graph)
from .kernels import KernelBuilder
from .kv_pages import fold_kv_appends
from .link import Linker, plan_dram
from .positions import evaluate_positions, position_limit, position_lookups

log = logging.getLogger("edgetvm")


class ModelCompiler:
    """Compile ``onnx_path`` (a text-generation-with-past export) for ``spec``."""

    def __init__(self, onnx_path, spec="edge-npu-16mb", *, quantize=None, max_tokens=None,
                 strategy: str = "regions", max_rows: int = 512, shape_overrides=None,
                 profile: str | None = None, knobs_for=None, cuts_for=None,
                 defaults_for=None, spread_for=None):
        """``knobs_for(kernel key) -> knobs or None``: the knobs each kernel is lowered
        with instead of the defaults; ``cuts_for(run key) -> cuts or None``: the kernel
        boundaries of each run of fusable ops instead of the strategy's
        (:mod:`edgetvm.build.cuts`); ``defaults_for(program name, build identity) ->
        bool``: whether a phase program (``decode_1x64p``, built by a compiler of
        :meth:`build_identity`) is built with neither, the strategy's partition and
        default knobs (the tuning log measured it slower tuned); ``spread_for(program
        name, build identity) -> bool``: whether its cross-kernel prefetches may be spread
        under the kernel before as the linker chooses, or go each at that kernel's end
        (the log measured it faster so; :attr:`spread_prefetch` off: at the end in every
        program). All four are a tuning log's replay (:class:`edgetvm.tune.log.Replay`)."""
        if strategy not in STRATEGIES:
            raise BuildError(f"unknown fusion strategy {strategy!r}; known: "
                             f"{', '.join(STRATEGIES)}")
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        self.strategy = strategy
        self.profile = self.spec.profile(profile).name      # an unknown profile fails here
        self._searches: dict = {}
        self._knobs_for = knobs_for
        self.cuts_for = cuts_for
        self.defaults_for = defaults_for
        self.spread_for = spread_for
        self.prefetch = True             # cross-kernel weight prefetch (link.py)
        self.spread_prefetch = True      # ... spread under a compute-bound kernel (link.py)
        self.max_rows = int(max_rows)
        t0 = time.time()
        imported = import_onnx(onnx_path, shape_overrides=shape_overrides)
        self.input_names, self.output_names = imported.input_names, imported.output_names
        _check_with_past(onnx_path, imported)
        _check_float(onnx_path, imported.op_histogram)
        mod = imported.mod
        self.quant_report = None
        if quantize:
            qpass = QuantizeW4A16(group_size=quantize) if isinstance(quantize, int) else quantize
            mod = qpass(mod)
            from edgetvm.relax_passes.quant_report import quantization_report
            self.quant_report = quantization_report(mod)
        mod = AnnotateLLMSemantics()(mod)
        self.mod, self.regions = offload_regions(mod, offloadable, "edgetvm.npu.build",
                                                 prune=unsound_offloads)
        log.info("front end: %d regions on the NPU %s in %.1fs", len(self.regions),
                 dict(Counter(r.kind for r in self.regions)), time.time() - t0)
        self._position_lookups = position_lookups(self.mod, self.regions)
        self.position_limit = position_limit(self._position_lookups)
        self.max_tokens = resolve_max_tokens(max_tokens, self.position_limit)
        #: what bounds the default KV capacity below DEFAULT_MAX_TOKENS, if anything
        self.capacity_bound = None
        if max_tokens is None and self.max_tokens < DEFAULT_MAX_TOKENS:
            self.capacity_bound = f"the model's position table of {self.position_limit} rows"
        self._tables: dict = {}
        self._checked_masks: set = set()
        self._slopes: dict = {}         # mask key -> ALiBi's slopes (None: causal only)
        self._windows: dict = {}        # mask key -> its sliding window, if it has one
        self._graphs: dict = {}
        self._linked: dict = {}
        self._partitions: dict = {}     # (id(graph), strategy, profile) -> (graph, groups)
        self.kernels = None
        self.layout = None
        if max_tokens is None:
            self._fit_default_capacity()
            if self.capacity_bound:
                log.warning("KV cache capacity %d tokens: %s", self.max_tokens,
                            self.capacity_bound)

    @property
    def knobs_for(self):
        """The kernels' knobs (see the constructor); settable: from then on every kernel
        is lowered with the new knobs (those built before are dropped)."""
        return self._knobs_for

    @knobs_for.setter
    def knobs_for(self, knobs_for) -> None:
        self._knobs_for = knobs_for
        if self.layout is not None:      # a graph was built already (the sliding window)
            self.kernels = KernelBuilder(self.spec, self.layout, knobs_for=knobs_for)
        self._searches.clear()
        self._partitions.clear()
        self._linked.clear()

    @property
    def sliding_windows(self) -> list:
        """The sliding windows of the model's attention masks found so far (shorter than
        the KV capacity; the attention kernels hide the keys behind them)."""
        return sorted(set(self._windows.values()))

    @property
    def page_tokens(self) -> int:
        return PAGE_TOKENS

    @property
    def num_pages(self) -> int:
        return -(-self.max_tokens // PAGE_TOKENS)

    def _fit_default_capacity(self) -> None:
        """Cap the default KV capacity at the positions an offset position table addresses
        (:class:`PositionTableError`). The decode graph of the largest capacity checks the
        masks and tables where the cache ends; it is the first graph every build needs.
        (A sliding window does not bound the cache: the attention kernel hides the keys
        behind it, ``add_sliding_windows``.)"""
        for _ in range(2):
            try:
                self.graph("decode", 1, capacity_bucket(self.num_pages))
                return
            except PositionTableError as err:
                if err.limit >= self.max_tokens or err.limit < 1:
                    raise
                self.max_tokens = err.limit
                self.capacity_bound = ("the positions the model's position table "
                                       "addresses at its offset")

    def graph(self, phase: str, rows: int, pages: int):
        """The phase graph of one bucket, its position tables filled in."""
        key = (phase, rows, pages)
        g = self._graphs.get(key)
        if g is not None:
            return g
        g, masks = extract_phase_graph(self.mod, self.regions, phase, rows, pages)
        todo = {n: v for n, v in g.position_tables.items() if n not in self._tables}
        new_masks = [(m, i) for m, i in masks if _mask_key(m) not in self._checked_masks]
        if todo or new_masks:
            sub = type(g)(g.phase, g.rows, g.pages, [], {}, g.logits, g.logits_rows,
                          g.kv_heads, g.head_dim, g.layers, todo)
            found = evaluate_positions(self.mod, self.regions, [sub], new_masks,
                                       self.max_tokens + self.max_rows,
                                       limit=self.position_limit, capacity=self.max_tokens,
                                       lookups=self._position_lookups)
            self._tables.update(found.tables)
            self._slopes.update({_mask_key(m): v for m, v in found.slopes.items()})
            self._windows.update({_mask_key(m): v for m, v in found.windows.items()})
            self._checked_masks |= {_mask_key(m) for m, _ in new_masks}
        for name in g.position_tables:
            t = g.tensors[name]
            t.data = self._tables[name]
            t.shape = t.data.shape
        slopes = {i: self._slopes.get(_mask_key(m)) for m, i in masks}
        add_alibi_slopes(g, {i: s for i, s in slopes.items() if s is not None})
        add_sliding_windows(g, {i: self._windows[_mask_key(m)] for m, i in masks
                                if _mask_key(m) in self._windows})
        if self.layout is None:
            self.layout = KVCacheLayout(g.kv_heads, g.head_dim, self.num_pages, PAGE_TOKENS)
            self.kernels = KernelBuilder(self.spec, self.layout, knobs_for=self.knobs_for)
        fold_kv_appends(g, self.layout)
        self._graphs[key] = g
        return g

    def fits(self, graph, group, kernels=None) -> bool:
        """Does the kernel of this group fit the TCM (lowered by ``kernels``, default
        :attr:`kernels`: with the replayed knobs, else the defaults)?"""
        try:
            (kernels or self.kernels).kernel(graph, group)
            return True
        except BuildError:
            return False

    def search(self, profile: str | None = None, defaults: bool = False):
        """The measured cut-point search of ``edgellm`` under ``profile`` (default: the
        compiler's); one per profile, its measurements shared by every phase and bucket
        (``defaults``: of kernels lowered with default knobs, not the replayed ones)."""
        from .search import SegmentSearch
        profile = self.spec.profile(profile or self.profile).name
        if (profile, defaults) not in self._searches:
            kernels = self._builder(defaults)
            self._searches[profile, defaults] = SegmentSearch(
                kernels, self.spec, profile, link=functools.partial(self.link, kernels=kernels))
        return self._searches[profile, defaults]

    def _builder(self, defaults: bool):
        """The kernel builder: :attr:`kernels`, or it lowering with default knobs."""
        return self.kernels.without_replay() if defaults else self.kernels

    def partition(self, graph, strategy: str | None = None, profile: str | None = None):
        """The op groups of ``graph`` under ``strategy`` (default: the compiler's), with
        the cuts of :attr:`cuts_for` where it has some."""
        groups = self.strategy_partition(graph, strategy, profile)
        return groups if self.cuts_for is None else \
            apply_cuts(graph, groups, self.cuts_for)

    def strategy_partition(self, graph, strategy: str | None = None,
                           profile: str | None = None, defaults: bool = False):
        """The op groups of ``graph`` under ``strategy`` alone (computed once per graph,
        strategy and profile: ``edgellm``'s is a search; ``defaults``: what fits and what
        the search measures lowered with default knobs, as a compiler without a tuning
        log has it)."""
        key = (id(graph), strategy or self.strategy, profile, defaults)
        hit = self._partitions.get(key)
        if hit is None or hit[0] is not graph:   # (the graph is held: its id stays its own)
            kernels = self._builder(defaults)
            hit = (graph, partition(
                graph, strategy or self.strategy,
                fits=lambda grp: self.fits(graph, grp, kernels),
                search=lambda gr: self.search(profile, defaults).partition(gr)))
            self._partitions[key] = hit
        return [list(g) for g in hit[1]]

    def build_identity(self, strategy: str | None = None) -> dict:
        """What, beside the tuning log's context and knobs, makes a phase program of this
        compiler what it is: the strategy, the KV capacity and the largest bucket (its
        position tables). A whole-program measurement holds for this identity only."""
        return {"strategy": strategy or self.strategy, "max_tokens": self.max_tokens,
                "max_rows": self.max_rows}

    def builds_defaults(self, phase: str, rows: int, pages: int,
                        strategy: str | None = None) -> bool:
        """Is program (phase, rows, pages) built with the strategy's partition and
        default knobs: the replayed log measured it faster so (:attr:`defaults_for`)?"""
        return self.defaults_for is not None and bool(self.defaults_for(
            program_name((phase, rows, pages)), self.build_identity(strategy)))

    def spreads(self, phase: str, rows: int, pages: int, strategy: str | None = None) -> bool:
        """May program (phase, rows, pages) spread its prefetches under the kernel before
        (:class:`~edgetvm.build.link.Linker`), or did the replayed log measure it faster
        with each at that kernel's end (:attr:`spread_for`)?"""
        return self.spread_prefetch and (self.spread_for is None or bool(self.spread_for(
            program_name((phase, rows, pages)), self.build_identity(strategy))))

    def groups(self, phase: str, rows: int, pages: int, strategy: str | None = None,
               profile: str | None = None):
        """The partition :meth:`program` links: the strategy's, with the log's cuts, or
        alone where :meth:`builds_defaults` (``profile``: the one an ``edgellm`` search
        measures under, default the compiler's)."""
        g = self.graph(phase, rows, pages)
        if self.builds_defaults(phase, rows, pages, strategy):
            return self.strategy_partition(g, strategy, profile, defaults=True)
        return self.partition(g, strategy, profile)

    def replay(self, replay) -> None:
        """Build from now on as the tuning log's ``replay`` says
        (:attr:`edgetvm.tune.log.Replay.compiler_options`: knobs, cuts, the programs
        built with the defaults and those whose prefetches go at the kernels' ends)."""
        opts = replay.compiler_options
        self.knobs_for = opts["knobs_for"]
        self.defaults_for = opts["defaults_for"]
        self.spread_for = opts["spread_for"]
        self.set_cuts(opts["cuts_for"])

    def set_cuts(self, cuts_for) -> None:
        """Use ``cuts_for`` (see the constructor) from now on."""
        self.cuts_for = cuts_for
        self._linked.clear()

    def program(self, phase: str, rows: int, pages: int, strategy: str | None = None,
                groups=None, keep: bool = True, spread: bool | None = None,
                profile: str | None = None):
        """The linked whole-phase program (``groups``: a partition to use instead of the
        strategy's; ``keep``: kept for the next call; ``spread``: whether its prefetches
        may be spread, instead of :meth:`spreads`; ``profile``: see :meth:`groups`)."""
        strategy = strategy or self.strategy
        key = (phase, rows, pages, strategy)
        cache = groups is None and keep and spread is None and profile is None
        if cache and key in self._linked:
            return self._linked[key]
        if rows > self.max_rows:
            raise BuildError(f"{rows} rows is over the largest bucket ({self.max_rows})")
        g = self.graph(phase, rows, pages)
        # the log measured it faster with the defaults (only for its own partition)
        defaults = groups is None and self.builds_defaults(phase, rows, pages, strategy)
        if spread is None:
            spread = self.spreads(phase, rows, pages, strategy) if groups is None \
                else self.spread_prefetch
        if groups is None:
            groups = self.groups(phase, rows, pages, strategy, profile)
        program = self.link(g, groups, program_name((phase, rows, pages)),
                            kernels=self._builder(defaults), spread=spread, strategy=strategy)
        if cache:
            self._linked[key] = program
        return program

    def link(self, graph, groups, name: str, kernels=None, spread: bool | None = None,
             **metadata):
        """One program running ``groups`` (a partition of ``graph.ops``) in order, its
        kernels lowered by ``kernels`` (default: :attr:`kernels`), its prefetches spread
        under compute-bound kernels if ``spread`` (default: :attr:`spread_prefetch`)."""
        consumers = graph.consumers()
        builder = self.kernels if kernels is None else kernels
        kernels = [builder.kernel(graph, grp, consumers) for grp in groups]
        plan = plan_dram(graph, kernels, self.spec.dram_burst_bytes)
        linker = Linker(graph, plan, self.spec, name, prefetch=self.prefetch,
                        spread=self.spread_prefetch if spread is None else spread)
        for k in kernels:
            linker.add(k)
        return linker.build(phase=graph.phase, rows=graph.rows, pages=graph.pages,
                            kernels=[{"name": k.name, "ops": [graph.ops[i].name for i in k.ops],
                                      "knobs": k.knobs} for k in kernels],
                            arena_bytes=plan.arena_elems * 2,
                            position_tables=sorted(graph.position_tables), **metadata)

    def phase_keys(self, rows, chunked: bool = False) -> list:
        """(phase, rows, pages) of the programs a generation run needs: prefill per length
        bucket from position 0, and the largest bucket at every KV capacity (a prompt
        longer than it runs as chunks of it, which may start anywhere; ``chunked``: the
        one chunk size), decode per power-of-two KV capacity."""
        top = capacity_bucket(self.num_pages)
        keys = []
        rows = sorted(set(rows))
        if rows[-1] > self.max_tokens:
            raise BuildError(f"a {rows[-1]}-row bucket does not fit a KV cache of "
                             f"{self.max_tokens} tokens")
        for r in rows:
            p = capacity_bucket(-(-r // PAGE_TOKENS))
            keys.append(("prefill", r, p))
            while (chunked or r == rows[-1]) and p < top:
                p *= 2
                keys.append(("prefill", r, p))
        p = 1
        while p <= top:
            keys.append(("decode", 1, p))
            p *= 2
        return keys


#: the KV capacity when neither the user nor the model says otherwise
DEFAULT_MAX_TOKENS = 1024


#: the largest KV capacity a build takes: the build checks the attention masks at the
#: cache's end, a (tokens x tokens) evaluation (8,192 tokens: 13 s and 0.95 GB for the tiny
#: Llama; 100,000 ran out of memory after 2 minutes)
MAX_KV_TOKENS = 16384


def resolve_max_tokens(asked, limit) -> int:
    """The KV capacity: ``asked``, else the default capped by the positions the model can
    address (``limit``, its learned position table); asking for more is refused."""
    if asked is None:
        if limit is not None and limit < DEFAULT_MAX_TOKENS:
            return limit
        return DEFAULT_MAX_TOKENS
    if int(asked) < 1:
        raise BuildError(f"a KV cache of {asked} tokens")
    if int(asked) > MAX_KV_TOKENS:
        raise BuildError(f"a KV cache of {asked} tokens: edgetvm builds caches of up to "
                         f"{MAX_KV_TOKENS} tokens")
    if limit is not None and int(asked) > limit:
        raise BuildError(f"the model looks positions up in a table of {limit} rows: a KV "
                         f"cache of {asked} tokens would read past it (--max-tokens {limit} "
                         f"or less)")
    return int(asked)


def _mask_key(m):
    """A mask var by the object it wraps (the Python wrappers of one Relax var are not one
    object, and two vars may share a name)."""
    handle = getattr(m, "__chandle__", None)
    return handle() if handle is not None else id(m)


def _check_with_past(onnx_path, imported) -> None:
    """Refuse, before anything is compiled, a model that is not a with-past export with
    symbolic lengths: the phase programs hold the KV cache in pages that its
    ``past_key_values.N.key/value`` inputs and ``present.N.key/value`` outputs name,
    serve every length of a bucket, and return its ``logits``."""
    inputs, outputs = imported.input_names, imported.output_names
    missing = [what for what, ok in (
        ("the input input_ids", "input_ids" in inputs),
        ("inputs past_key_values.N.key/value",
         any(n.startswith("past_key_values.") for n in inputs)),
        ("the output logits", "logits" in outputs),
        ("outputs present.N.key/value", any(n.startswith("present.") for n in outputs)))
        if not ok]
    if missing:
        raise BuildError(
            f"{onnx_path}: not a text-generation-with-past export (missing: "
            f"{', '.join(missing)}; its inputs: {', '.join(inputs) or 'none'}): the NPU "
            f"programs keep the KV cache in pages those inputs and outputs name. Export "
            f"the model with optimum's text-generation-with-past task (optimum-cli export "
            f"onnx --task text-generation-with-past ...)")
    params = dict(zip(inputs, imported.mod["main"].params))
    fixed = [f"{n} {tuple(int(d) for d in shape)}" for n in ("input_ids", next(
        n for n in inputs if n.startswith("past_key_values.")))
        for shape in [params[n].ty.shape.values]
        if all(isinstance(d, tvm.tirx.IntImm) for d in shape)]
    if fixed:
        raise BuildError(
            f"{onnx_path}: its lengths are fixed ({'; '.join(fixed)}): the NPU programs "
            f"serve every prompt length of a bucket and a growing KV cache, so the export's "
            f"sequence and past lengths must be symbolic (an optimum export keeps them so; "
            f"or pass dynamic axes to torch.onnx.export)")


#: ops that quantize activations (dynamic or static int8 quantization)
_INT8_ACTIVATION_OPS = ("DynamicQuantizeLinear", "QuantizeLinear", "MatMulInteger",
                        "QLinearMatMul", "ConvInteger", "QLinearConv",
                        "com.microsoft:DynamicQuantizeMatMul",
                        "com.microsoft:MatMulIntegerToFloat")


def _check_float(onnx_path, op_histogram: dict) -> None:
    """Refuse a model whose activations are quantized to int8 (onnxruntime's
    ``quantize_dynamic`` or ``quantize_static``): the NPU computes float16 activations,
    with float16 or 4-bit weights. (Weight-only formats compile: MatMulNBits, and a
    DequantizeLinear of a constant, which folds to float weights.)"""
    found = [f"{op} x{op_histogram[op]}" for op in _INT8_ACTIVATION_OPS if op in op_histogram]
    if found:
        raise BuildError(
            f"{onnx_path}: its activations are quantized to int8 ({', '.join(found)}): the "
            f"NPU computes float16 activations with float16 or 4-bit weights (W4A16). "
            f"Compile the float export instead, with --quantize G for 4-bit weights")
