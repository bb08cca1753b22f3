"""Many prompts at once (`Engine.generate_batch`): the rows take and put through the
same tiered cache as `generate`, a prefix several rows share is prefilled once, and
the rows decode together in mlx-lm's `BatchGenerator`.

1. Each row takes its longest cached prefix (RAM, SSD, remote) as `generate` does.
2. Where rows branch beyond what the cache held (the branching points of their
   token trie), the prefix they share is prefilled once and published; the rows
   branch from it (views: nothing is copied until a row appends).
3. Each row prefills the rest of its prompt but the last token on its own, as a
   single generation does, so its prompt state is the one `generate` computes and
   publishes (with the prompt snapshot of a window or recurrent model).
4. The rows decode together: mlx-lm merges their caches into its batch caches
   (left padded: a copy of every row's KV), `batch_size` rows at a time; the next
   row joins when one finishes. Decoding at batch size B has B's numerics, so a
   batch is exact against the same batch with the cache off, not against `generate`.
5. A finished row publishes its state like a single generation.

Cache kinds mlx-lm cannot batch (quantized KV, chunked attention), and vision-language
models, run steps 3-5 row after row with `generate`'s own decode, after a notice. Row i samples with
seed + i (or its own seed from a list), through the (seed, step) sampler of `generate`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from .sampling import GenerationError, SamplingParams, sample_logprobs
from .decoding import prefill
from .kv.checkpoint import Checkpoint
from .kv.caches import not_batchable
from .kv.tokens import branch_points
from .memory import DECODE_CHECK_EVERY
from .metrics import generation_stats
from .models import LoadedModel
from .cache.entry import Loan
from .generation import Generation, GenerationResult, Request, Services

MIN_SHARED_TOKENS = 16  # a shorter shared prefix is prefilled by each row: a published entry would cost more
DEFAULT_BATCH_SIZE = 32  # rows decoding at once (mlx-lm's own completion batch size)


def batch_seeds(seed, rows: int) -> list:
    """Row i's seed: seed + i, or seed[i] from a list of one seed per row."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != rows:
            raise GenerationError(f"seed: a list needs one seed per prompt ({rows}), got {len(seed)}")
        return list(seed)
    if not isinstance(seed, int) or seed < 0:
        raise GenerationError(f"seed must be an integer >= 0 (or a list of one per prompt), got {seed!r}")
    return [seed + i for i in range(rows)]


def row_tokens(prompts, encode: Callable[[str], list], vocab_size: int | None) -> list[list[int]]:
    """Each prompt as token ids: a string is encoded, a list of ids is used as it is."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise GenerationError(f"prompts must be a list of prompts (strings or token-id lists), got {type(prompts).__name__}")
    rows = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            try:
                rows.append(encode(p))
            except GenerationError as e:
                raise GenerationError(f"prompt {i}: {e}") from None
            continue
        if isinstance(p, (bytes, bytearray)):  # a Sequence of ints, but surely meant as text
            raise GenerationError(f"prompt {i}: bytes, not a string or token ids; decode it first")
        if not isinstance(p, Sequence) or not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise GenerationError(f"prompt {i}: a prompt is a non-empty string or a non-empty list of token ids")
        bad = [t for t in p if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise GenerationError(f"prompt {i}: token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
        rows.append([int(t) for t in p])
    return rows


@dataclass(eq=False)
class Branch:
    """A prefix several rows share, prefilled once in this batch."""

    tokens: tuple
    checkpoint: Checkpoint
    cached: int  # how much of it the cache held before
    source: str | None


@dataclass(eq=False)
class Row:
    index: int
    gen: Generation  # its text stream, decoded tokens, times and publication
    loan: "Loan | None" = None
    cached: int = 0  # prompt tokens the cache held before the batch
    source: str | None = None
    shared: int = 0  # prompt tokens prefilled once in this batch, shared with other rows
    prefilled: int = 0  # prompt tokens this row forwarded on its own (the last one included)
    lookup_s: float = 0.0
    prefill_s: float = 0.0
    result: GenerationResult | None = None

    @property
    def tokens(self) -> list:
        return self.gen.req.tokens


class BatchRun:
    """One `generate_batch` call; `run()` once."""

    def __init__(self, services: Services, model: LoadedModel, prompts: list, params: list, *, use_cache: bool,
                 batch_size: int = DEFAULT_BATCH_SIZE, on_progress: Callable[[str, int, int], None] | None = None,
                 on_row: Callable[[int, GenerationResult], None] | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise GenerationError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.services, self.model, self.cache, self.ns = services, model, services.cache, model.namespace
        self.use_cache = use_cache and model.cache_notice is None  # an unknown cache class: uncached, never wrong
        self.rows = [Row(i, Generation(services, Request(model, t, p, use_cache=self.use_cache)))
                     for i, (t, p) in enumerate(zip(prompts, params))]
        self.batch_size, self.on_progress, self.on_row = batch_size, on_progress, on_row
        self.branches: list[Branch] = []
        self.loans: list = []  # held until the run ends: nothing hands their buffers to another borrower meanwhile
        unbatchable = (["a vision-language model's"] if getattr(model, "vision", None) is not None
                       else not_batchable(model.new_caches()))
        self.notice = (f"mlx-lm cannot batch {', '.join(unbatchable)} caches: the {len(self.rows)} rows run one "
                       "after another" if unbatchable else None)
        self.t0 = 0.0

    def run(self) -> list[GenerationResult]:
        self.t0 = time.perf_counter()
        if hasattr(mx, "reset_peak_memory"):
            mx.reset_peak_memory()
        if self.notice:
            self.services.events.emit("notice", model=self.model.name, message=self.notice)
        try:
            with self.cache.generating():
                if self.model.cache_notice is None:  # shared prefixes live in checkpoints: known cache classes only
                    self._look_up()
                    self._share()
                self._serial() if self.notice else self._batched()
        finally:
            for loan in self.loans:
                loan.release()
            if self.use_cache:
                self.cache.queue_dirty()  # shared prefixes and prompt snapshots no final checkpoint covers
        self.cache.loading.prepare_reads()
        return [row.result for row in self.rows]

    # --- prompts ---

    def _look_up(self) -> None:
        if not self.use_cache:
            return
        for row in self.rows:
            t = time.perf_counter()
            row.loan = self._take(row.tokens)
            if row.loan is not None:
                row.cached, row.source = min(row.loan.length, len(row.tokens)), row.loan.source
            row.lookup_s = time.perf_counter() - t

    def _take(self, tokens):
        loan = self.cache.take(tokens, self.ns, progress=self.on_progress)
        if loan is not None:
            self.loans.append(loan)
        return loan

    def _share(self) -> None:
        """Prefill once every prefix that two or more rows need beyond what the cache held."""
        bodies = [tuple(r.tokens[:-1]) for r in self.rows]
        for point in branch_points(bodies, MIN_SHARED_TOKENS):
            n = len(point)
            needing = [b for r, b in zip(self.rows, bodies) if r.cached < n and b[:n] == point]
            ends = [b[n] if len(b) > n else None for b in needing]
            if len(needing) >= 2 and (None in ends or len(set(ends)) >= 2):  # they branch here, not further on
                self.branches.append(self._prefill_branch(point))

    def _prefill_branch(self, point: tuple) -> Branch:
        parent = self._branch_for(point, len(point) - 1)
        start, cached, source = (len(parent.tokens), parent.cached, parent.source) if parent else (0, 0, None)
        loan = self._take(point + (-1,)) if self.use_cache else None  # the sentinel: at most the point itself
        if loan is not None and loan.length > start:
            caches, start, cached, source = loan.caches, loan.length, loan.length, loan.source
        else:
            caches = parent.checkpoint.lend(start) if parent else self.model.new_caches()
        t = time.perf_counter()
        self._prefill(caches, point[start:])
        cp = Checkpoint.capture(point, caches)
        if start < len(point):
            self.services.metrics.record_prefill(self.ns, len(point) - start, time.perf_counter() - t)
            if self.use_cache:  # written after the batch unless a row's final state covers it
                self.cache.put(cp, self.ns, defer_write=True)
        return Branch(point, cp, cached, source)

    def _branch_for(self, body: tuple, limit: int) -> Branch | None:
        """The longest branch of this batch that is a prefix of `body`, at most `limit` long."""
        found = [b for b in self.branches if len(b.tokens) <= limit and body[: len(b.tokens)] == b.tokens]
        return max(found, key=lambda b: len(b.tokens), default=None)

    def _prepare(self, row: Row) -> list:
        """The row's caches holding its prompt but the last token: its loan or a branch, then its own prefill."""
        body = tuple(row.tokens[:-1])
        branch = self._branch_for(body, len(body))
        if branch is not None and len(branch.tokens) > row.cached:
            start = len(branch.tokens)
            caches = branch.checkpoint.lend(start)
            row.cached, row.source, row.shared = branch.cached, branch.source, start - branch.cached
        else:
            start = row.cached
            caches = row.loan.caches if row.loan is not None else self.model.new_caches()
        t = time.perf_counter()
        self._prefill(caches, row.tokens[start:-1])
        row.prefill_s = time.perf_counter() - t
        row.prefilled = len(row.tokens) - start  # the last prompt token goes in with the first decode step
        self.services.memory.check("prefill")
        if self.use_cache:
            row.gen.snapshot_prompt(caches)
        return caches

    def _prefill(self, caches: list, tokens: Sequence[int]) -> None:
        if tokens:
            progress = self.on_progress
            prefill(self.model.model, caches, list(tokens), chunk=self.services.prefill_chunk,
                    progress=(lambda done, total: progress("prefill", done, total)) if progress else None)

    # --- decoding ---

    def _batched(self) -> None:
        from mlx_lm.generate import BatchGenerator

        size = min(self.batch_size, len(self.rows))
        gen = BatchGenerator(self.model.model, stop_tokens=[[t] for t in sorted(self.model.eos_token_ids)],
                             prefill_batch_size=size, completion_batch_size=size,
                             prefill_step_size=self.services.prefill_chunk)
        pending, active, finished = deque(self.rows), {}, []
        total = sum(r.gen.req.params.max_tokens for r in self.rows)
        generated = 0
        try:
            for step in itertools.count():
                joined = []
                while pending and len(active) < size:  # a row joins as another finishes
                    row = pending.popleft()
                    p = row.gen.req.params
                    [uid] = gen.insert([row.tokens[-1:]], max_tokens=[p.max_tokens], caches=[self._prepare(row)],
                                       all_tokens=[row.tokens[:-1]], samplers=[_sampler(p)])
                    active[uid] = row
                    joined.append(row)
                if not active:
                    break
                responses = gen.next_generated()
                if not responses:
                    raise RuntimeError("mlx-lm's BatchGenerator stopped before every row finished")
                for row in joined:  # merged into the batch caches (a copy): the row's own caches can go
                    if row.loan is not None:
                        row.loan.release()
                now = time.perf_counter()
                for r in responses:
                    generated += 1
                    if self._add_token(active[r.uid], r, now):
                        if r.finish_reason is None:  # a stop string: out of the batch, with its state
                            caches, known = gen.remove([r.uid], return_prompt_caches=True)[r.uid]
                        else:
                            caches, known = r.prompt_cache, r.all_tokens
                        finished.append((active.pop(r.uid), caches, known))
                while finished:  # the others' states are kept even if a callback raises
                    self._finish(*finished.pop(0))
                if step and step % DECODE_CHECK_EVERY == 0:
                    self.services.memory.check("decode")
                if self.on_progress is not None:
                    self.on_progress("decode", generated, total)
        except BaseException:
            if self.use_cache:
                self._keep_unfinished(gen, active, finished)
            raise
        finally:
            gen.close()

    @staticmethod
    def _add_token(row: Row, r, now: float) -> bool:
        """Record one generated token; True when the row is done."""
        g = row.gen
        g.times.append(now)
        g.decoded.tokens.append(r.token)
        if r.finish_reason == "stop":  # one of the model's end tokens (not shown, as in `generate`)
            g.decoded.finish_reason = "eos"
            return True
        g.stream.add(r.token)
        if g.stream.stopped or r.finish_reason == "length":
            g.decoded.finish_reason = "stop" if g.stream.stopped else "length"
            return True
        return False

    def _finish(self, row: Row, caches: list, known: list) -> None:
        self._publish(row, caches, known)
        self._result(row)

    def _publish(self, row: Row, caches: list, known: list) -> None:
        g = row.gen
        g.stream.finish()
        g.decode_ran, g.decoded.forwarded = True, len(g.decoded.tokens)  # a batch forwards every emitted token
        if self.use_cache:
            if list(known) == g.known_tokens():
                g.publish_final(caches)
            else:  # never publish a state under tokens it may not hold
                self.services.events.emit("publish_skipped", ns=self.ns, row=row.index, reason="token mismatch")

    def _keep_unfinished(self, gen, active: dict, finished: list) -> None:
        """An interrupted batch publishes the rows mlx-lm finished, and what its unfinished rows
        computed (cut back to the tokens they hold), so a rerun continues there."""
        for row, caches, known in finished:
            try:
                self._publish(row, caches, known)
            except Exception:
                pass  # never mask the interrupt
        try:
            extracted = gen.extract_cache(list(active))
        except Exception:
            return
        for uid, (caches, known) in extracted.items():
            try:
                active[uid].gen.publish_interrupted(list(known), caches)
            except Exception:
                pass  # never mask the interrupt

    def _serial(self) -> None:
        """Rows one after another with `generate`'s decode (caches mlx-lm cannot batch)."""
        total, before = sum(r.gen.req.params.max_tokens for r in self.rows), 0
        for row in self.rows:
            caches = self._prepare(row)
            g = row.gen
            if self.on_progress is not None:  # decode progress in tokens, as the batched path reports it
                g.req.on_text = lambda _piece, g=g, before=before: self.on_progress("decode", before + len(g.times),
                                                                                      total)
            try:
                g.decode_tokens(caches)
            except BaseException:
                if self.use_cache:
                    try:
                        g.publish_interrupted(g.known_tokens(), caches)
                    except Exception:
                        pass
                raise
            if self.use_cache:
                g.publish_final(caches)
            if row.loan is not None:
                row.loan.release()
            before += len(g.times)
            self._result(row)

    def _result(self, row: Row) -> None:
        g = row.gen
        stats = generation_stats(
            prompt_tokens=len(row.tokens), cached=row.cached, source=row.source, prefilled=row.prefilled,
            lookup_s=row.lookup_s, prefill_s=row.prefill_s, t0=self.t0, token_times=g.times,
            decode_tokens=len(g.decoded.tokens), finish_reason=g.decoded.finish_reason,
            peak_memory=int(mx.get_peak_memory()) if hasattr(mx, "get_peak_memory") else None,
        )
        stats.update(batch_index=row.index, batch_rows=len(self.rows), batch_shared_tokens=row.shared,
                     batch_mode="serial" if self.notice else "batched")
        self.services.metrics.record(self.ns, stats)
        row.result = GenerationResult(g.stream.text, list(g.decoded.tokens), stats, list(row.tokens))
        self.services.events.emit("generation", **{k: v for k, v in stats.items() if not isinstance(v, (list, dict))})
        if self.on_row is not None:
            self.on_row(row.index, row.result)


def _sampler(params: SamplingParams):
    """mlx-lm's per-row sampler: None (its greedy argmax, one call for the batch) or `generate`'s
    (seed, step) draw, one step per call."""
    if params.temperature == 0:
        return None
    steps = itertools.count()
    return lambda logprobs: sample_logprobs(logprobs, params, next(steps))
