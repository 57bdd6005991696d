"""Running a compiled model: one whole-phase program per step, the KV cache on the device.

A :class:`ModelRunner` holds the phase programs of one model (by ``(phase, rows, pages)``),
the page allocation of the sequence (:class:`~edgetvm.kv_state.KVState`) and a runner
device, whose persistent ``state`` tensors are the KV cache pages. A step picks the
program of its bucket (prefill: the smallest length bucket that holds the chunk; decode:
the smallest KV capacity that holds the sequence), sets the runtime parameters (token ids,
position, valid length, where the new K/V go, the page table) and runs it once: the step's
cycles, DRAM traffic, energy and power are that one run's. Nothing here compiles.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edgetvm.errors import EdgeTVMError
from edgetvm.generate import StepRecord, check_capacity, check_vocab
from edgetvm.kv_state import KVState


@dataclass(frozen=True)
class ModelInfo:
    """What the runtime needs to know about a compiled model (the artifact's manifest)."""

    layers: int
    kv_heads: int
    head_dim: int
    page_tokens: int
    max_tokens: int
    vocab: int


def program_name(key) -> str:
    """``prefill_16x1p``: phase, rows, KV pages."""
    return "{}_{}x{}p".format(*key)


class ModelRunner:
    """Generation with the phase programs ``programs`` (key -> Program, or a callable that
    returns the Program of a key) on ``runner`` (``edgetvm.runner.connect(...)``);
    ``page_pool``: the order free KV pages are handed out (see ``KVState``)."""

    def __init__(self, programs, keys, info: ModelInfo, runner, profile: str | None = None,
                 page_pool=None):
        self._programs = programs
        self.keys = sorted(tuple(k) for k in keys)
        self.info = info
        self.runner = runner
        self.profile = profile
        self.kv = KVState(info.layers, info.kv_heads, info.head_dim, info.max_tokens,
                          page_tokens=info.page_tokens, page_pool=page_pool)
        self.prefill_rows = sorted({r for p, r, _ in self.keys if p == "prefill"})
        self.traced = None
        if not self.prefill_rows or not any(p == "decode" for p, _, _ in self.keys):
            raise EdgeTVMError("the model has no prefill or no decode program")

    def program(self, key):
        p = self._programs(key) if callable(self._programs) else self._programs[key]
        return p

    def reset(self) -> None:
        """A new sequence: its pages are handed out again from the start."""
        self.kv.reset()

    # -- one step ------------------------------------------------------------------------------
    def key_for(self, tokens: int, pos: int) -> tuple:
        """The program of a step of ``tokens`` new tokens at ``pos``."""
        pages_needed = -(-(pos + tokens) // self.info.page_tokens)
        if tokens == 1:
            cands = [k for k in self.keys if k[0] == "decode" and k[2] >= pages_needed]
        else:
            if tokens > self.prefill_rows[-1]:
                raise EdgeTVMError(f"a chunk of {tokens} tokens is over the largest prefill "
                                   f"bucket ({self.prefill_rows[-1]}); use chunks")
            # the smallest bucket that holds the chunk, at a KV capacity that holds the
            # bucket's rows from pos: a small bucket has only the capacity of its own rows
            # from 0, so a later chunk takes a larger one (the largest has every capacity)
            cands = [k for k in self.keys if k[0] == "prefill" and k[1] >= tokens and
                     k[2] >= -(-(pos + k[1]) // self.info.page_tokens)]
            room = self.kv.page_room          # what KVState.reserve lets a step write
            if cands and all(pos + k[1] > room for k in cands):
                # the chunk is padded to its bucket, and the bucket's rows are written
                rows = min(k[1] for k in cands)
                raise EdgeTVMError(
                    f"a chunk of {tokens} tokens at position {pos} runs padded to a "
                    f"{rows}-row bucket, past the KV cache of {self.info.max_tokens} "
                    f"tokens (build with --chunk {self.info.page_tokens} or "
                    f"--max-tokens {pos + rows})")
            cands = [k for k in cands if pos + k[1] <= room]
            if cands:
                cands = [k for k in cands if k[1] == min(c[1] for c in cands)]
        if not cands:
            raise EdgeTVMError(f"no program for {tokens} token(s) at position {pos}: the "
                               f"artifact has {', '.join(map(program_name, self.keys))} "
                               f"(build with --chunk or a larger --max-tokens)")
        return min(cands, key=lambda k: k[2])

    def step(self, ids, pos: int, trace: bool = False):
        """Run ``ids`` (new tokens at positions ``pos..``); returns (logits of the last new
        token (vocab,), counters dict, key). With ``trace``, :attr:`traced` is then
        ``(key, run result)`` with the per-command trace."""
        ids = [int(i) for i in ids]
        s = len(ids)
        if pos + s > self.info.max_tokens:
            raise EdgeTVMError(f"the KV cache holds {self.info.max_tokens} tokens; this step "
                               f"needs {pos + s}")
        check_vocab(ids, self.info.vocab)
        key = self.key_for(s, pos)
        program = self.program(key)
        params = self.params_for(program, key, ids, pos)
        res = self.runner.run(program, {}, params, profile=self.profile, trace=trace)
        if trace:
            self.traced = (key, res)
        logits = np.asarray(res.outputs["logits"], np.float32).reshape(-1, self.info.vocab)
        # one row (the last token's), or one per row of the bucket: the last token's is s - 1
        logits = logits[0] if len(logits) == 1 else logits[s - 1]
        self.kv.length = pos + s
        return logits, res.counters, key

    def params_for(self, program, key, ids, pos: int) -> dict:
        """The runtime parameters of ``program`` (the program of ``key``) running ``ids``
        at ``pos``; reserves the KV pages the step writes."""
        s = len(ids)
        _, rows, pages = key
        if pos == 0:
            self.kv.reset()
        self.kv.reserve(pos, rows)
        lay = self.kv.layout
        params = {f"ids.{i}": (ids[i] % self.info.vocab if i < s else 0) for i in range(rows)}
        params.update(pos=pos, valid_len=pos + s, last_row=s - 1)
        params.update(lay.slot_params(self.kv.page_table, pos, rows, s))
        params.update(lay.page_table_params(self.kv.page_table, pages))
        if "dst_page.0" in program.params:        # the prefill writes whole pages
            if pos % lay.page_tokens:
                raise EdgeTVMError(f"{program_name(key)} appends whole KV pages: it runs at "
                                   f"a page boundary, not at position {pos} (chunks that "
                                   f"are not whole pages need a --chunk build)")
            first = pos // lay.page_tokens
            params.update({f"dst_page.{i}": self.kv.page_table[first + i]
                           for i in range(rows // lay.page_tokens)})
        return {k: v for k, v in params.items() if k in program.params}

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int, chunk: int | None = None,
                 on_step=None, trace_first: str | None = None) -> list:
        """Greedy generation: the prompt as one prefill (or chunks of ``chunk`` tokens),
        then decode steps; one :class:`~edgetvm.generate.StepRecord` per step (a chunk that
        does not end the prompt has token -1). ``trace_first``: trace the first step of
        that phase (``decode``; the prefill if there is no decode step)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise EdgeTVMError("the prompt is empty")
        check_capacity(len(prompt), max_new_tokens, self.info.max_tokens)
        self.reset()
        size = chunk or (self.prefill_rows[-1] if len(prompt) > self.prefill_rows[-1] else
                         len(prompt))
        pieces = [prompt[i:i + size] for i in range(0, len(prompt), size)]
        # every step has a program, or nothing runs (not a refusal after the first chunks)
        at = 0
        try:
            for piece in pieces:
                key = self.key_for(len(piece), at)
                if at % self.info.page_tokens and "dst_page.0" in self.program(key).params:
                    raise EdgeTVMError(
                        f"a chunk at position {at}: {program_name(key)} appends whole KV "
                        f"pages (chunks at multiples of {self.info.page_tokens} tokens)")
                at += len(piece)
        except EdgeTVMError as e:
            if chunk is None:
                raise
            raise EdgeTVMError(f"chunks of {chunk}: {e}; build the model with --chunk "
                               f"{chunk}, or run without --chunk") from None
        if max_new_tokens > 1:
            self.key_for(1, at + max_new_tokens - 2)
        records, pos, token = [], 0, None
        calls = [("prefill", p) for p in pieces]
        generated = 0
        while calls or generated < max_new_tokens:
            phase, ids = calls.pop(0) if calls else ("decode", [token])
            t0 = time.perf_counter()
            want = trace_first is not None and self.traced is None and (
                phase == trace_first or (max_new_tokens == 1 and not calls))
            logits, c, key = self.step(ids, pos, trace=want)
            token = int(np.argmax(logits))
            last = phase == "decode" or not calls
            rec = StepRecord(phase, token if last else -1, len(ids), pos, logits=logits)
            rec.npu_cycles, rec.npu_us = int(c["total_cycles"]), float(c["time_us"])
            rec.dram_read_bytes, rec.dram_write_bytes = c["dram_read_bytes"], c["dram_write_bytes"]
            rec.energy_uj, rec.avg_power_mw = c["energy_uj"], c["avg_power_mw"]
            rec.peak_power_mw, rec.throttled_cycles = c["peak_power_mw"], c["throttled_cycles"]
            rec.program, rec.wall_s = program_name(key), time.perf_counter() - t0
            records.append(rec)
            if on_step is not None:
                on_step(rec)
            pos += len(ids)
            if last:
                generated += 1
                if generated >= max_new_tokens:
                    break
        return records
