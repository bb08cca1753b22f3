"""Many prompts at once (`Engine.generate_batch`): the rows take and put through the
same tiered cache as `generate`, a prefix several rows share is prefilled once, and
the rows decode together.

1. Each row takes its longest cached prefix (RAM, SSD, remote) as `generate` does.
2. Where rows branch beyond what the cache held (the branching points of their
   token trie), the prefix they share is prefilled once and published; the rows
   branch from it (views: nothing is copied).
3. Rows of plain-KV models decode over their shared prefixes (shared.py): each
   prefix is held and attended to once for all its rows (no copy per row, no padding
   of a row to another's prefix); the rows' own positions sit in one tail, their
   prompts' rests prefilled together. With quantized KV (kv_bits, from kv_start on) each
   row converts at exactly kv_start at its own step (kv/cascade_quantized.py).
4. Other models' rows (sliding windows, recurrent layers, a model attending to keys of
   its own making) prefill their rests on their own and merge into mlx-lm's
   `BatchGenerator` (merged.py: left padded, a copy of every row's KV).
5. A finished row publishes its state like a single generation.

Decoding B rows together has B's numerics, so a batch is exact against the same batch
with the cache off and within rounding of each row run alone. Cache kinds mlx-lm cannot
batch (chunked attention; quantized KV beside other kinds), and vision-language models, run row after row
with `generate`'s own decode, after a notice. Row i samples with seed + i (or its own
seed from a list), through the (seed, step) sampler of `generate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from ..sampling import GenerationError
from ..loop import Row as LoopRow
from ..constrain import Constraint
from ..speculative.proposers import Choice, choose_proposers
from ..prefill import prefill
from ...host.memory import DECODE_CHECK_EVERY
from ...kv.checkpoint import Checkpoint
from .merged import MergedRows
from .shared import SharedPrefixRows
from ...kv.caches import new_caches, not_batchable, shares_prefix
from ...kv.cascade import Unroutable, routing
from ...kv.tokens import branch_points
from ...metrics import generation_stats
from ...models.registry import LoadedModel
from ...cache.entry import Loan
from ..generation import Generation, GenerationResult, Request, Services

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
    drafts: Choice = field(default_factory=Choice)  # drafts from its context, in a shared-prefix batch

    @property
    def tokens(self) -> list:
        return self.gen.req.tokens


class BatchRun:
    """One `generate_batch` call; `run()` once."""

    def __init__(self, services: Services, model: LoadedModel, prompts: list, params: list, *, use_cache: bool,
                 lookup: bool | None = None, constraints: list | None = None, truncate: str | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, on_progress: Callable[[str, int, int], None] | None = None,
                 on_row: Callable[[int, GenerationResult], None] | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise GenerationError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.services, self.model, self.cache, self.ns = services, model, services.cache, model.namespace
        self.use_cache = use_cache and model.cache_notice is None  # an unknown cache class: uncached, never wrong
        constraints = constraints or [None] * len(prompts)
        requests = [Request(model, t, p, use_cache=self.use_cache, lookup=lookup, constraint=c, truncate=truncate)
                    for t, p, c in zip(prompts, params, constraints)]
        for i, r in enumerate(requests):  # a row past the model's window: refused (or cut) before any work
            try:
                r.check(has_ssd=True)
            except GenerationError as e:
                raise GenerationError(f"prompt {i}: {e}") from None
        self.rows = [Row(i, Generation(services, r)) for i, r in enumerate(requests)]
        self.batch_size, self.on_progress, self.on_row = batch_size, on_progress, on_row
        self.branches: list[Branch] = []
        self.loans: list = []  # held until the run ends: nothing hands their buffers to another borrower meanwhile
        # rows of plain-KV models attend to a shared prefix once (shared.py), with quantized KV
        # too (kv/cascade_quantized.py); others merge in mlx-lm's batch, which cannot quantize
        self.quantized = model.kv_bits is not None
        vision = getattr(model, "vision", None) is not None
        plain = not vision and shares_prefix(new_caches(model.model))  # every layer plain KV (unquantized)
        if vision or (self.quantized and plain):
            why = "mlx-lm cannot batch a vision-language model's caches" if vision else None
        elif self.quantized:
            why = "mlx-lm cannot batch quantized KV, and this model's layers are not all plain KV"
        else:
            blockers = not_batchable(model.new_caches())
            why = f"mlx-lm cannot batch {', '.join(blockers)} caches" if blockers else None
        self.notice = f"{why}: the {len(self.rows)} rows run one after another" if why else None
        self.shared_prefix = self.notice is None and plain
        self.mode = "serial" if self.notice else "shared-prefix" if self.shared_prefix else "batched"
        self.steps = 0  # decode steps the batch took (memory checks)
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
                if self.notice:
                    self._serial()
                elif not (self.shared_prefix and self._shared()):
                    self._batched()
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

    def _start(self, row: Row) -> tuple:
        """(caches holding what the row starts from, how many prompt tokens they hold): the longest
        of its loan and the batch's shared prefixes; (None, 0) when neither holds anything."""
        body = tuple(row.tokens[:-1])
        branch = self._branch_for(body, len(body))
        if branch is not None and len(branch.tokens) > row.cached:
            start = len(branch.tokens)
            row.cached, row.source, row.shared = branch.cached, branch.source, start - branch.cached
            return branch.checkpoint.lend(start), start
        return (row.loan.caches, row.cached) if row.loan is not None and row.cached else (None, 0)

    def _prepare(self, row: Row) -> list:
        """The row's caches holding its prompt but the last token: where it starts, then its own prefill."""
        caches, start = self._start(row)
        caches = caches if caches is not None else self.model.new_caches()
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
            prefill(self.model.forward, caches, list(tokens), chunk=self.services.prefill_chunk,
                    progress=(lambda done, total: progress("prefill", done, total)) if progress else None)

    # --- decoding ---

    def _shared(self) -> bool:
        """The rows in waves of batch_size over their shared prefixes; False (nothing done) when the
        model attends to keys of its own making: then the rows merge in mlx-lm's batch instead."""
        for at in range(0, len(self.rows), self.batch_size):
            rows = self.rows[at : at + self.batch_size]
            wave = SharedPrefixRows(self, rows, [self._start(r) for r in rows])
            with routing(self.model.model) as routed:
                if not routed:
                    return self._unshared("it does not attend through mlx-lm's attention") if at == 0 else False
                try:
                    wave.run_wave()
                except Unroutable as e:
                    if at or any(r.result for r in rows):
                        raise
                    return self._unshared(str(e))
                except BaseException:
                    if self.use_cache:
                        wave.keep_unfinished()
                    raise
        return True

    def _unshared(self, why: str) -> bool:
        self.shared_prefix, self.mode = False, "serial" if self.quantized else "batched"
        if self.quantized:  # mlx-lm's batch has no quantized KV
            self.notice = f"{why}: the {len(self.rows)} rows of quantized KV run one after another"
            self.services.events.emit("notice", model=self.model.name, message=self.notice)
            self._serial()
            return True
        self.services.events.emit("notice", model=self.model.name,
                                  message=f"rows copy their shared prefix into mlx-lm's batch: {why}")
        return False

    def _batched(self) -> None:
        MergedRows(self).run()

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
            self.result(row)

    def loop_row(self, row: Row) -> LoopRow:
        """The row as the token loop advances it in a batch: its prompt's last token pending, its text
        streamed and its stop strings checked as `generate` does."""
        g = row.gen

        def on_token(token: int, step: int) -> bool:
            g.stream.add(token)
            return g.stream.stopped

        if self.mode == "shared-prefix":
            row.drafts = choose_proposers(self.services, g.req, (), len(row.tokens))
        else:
            row.drafts = Choice(lookup_fallback="rows merged in mlx-lm's batch caches cannot cut rejected drafts "
                                                "back one by one: decoding without drafts from the context")
        g.constraint = Constraint(g.req.constraint) if g.req.constraint is not None else None
        loop_row = LoopRow(g.req.params, row.tokens[-1:], eos_ids=self.model.eos_token_ids, context=row.tokens,
                           on_token=on_token, into=g.decoded, proposer=row.drafts.proposer, constraint=g.constraint)
        g.times = loop_row.times
        return loop_row

    def step_done(self, total: int) -> None:
        """After every batch step: a memory reading now and then, progress in tokens generated."""
        self.steps += 1
        if self.steps % DECODE_CHECK_EVERY == 0:
            self.services.memory.check("decode")
        if self.on_progress is not None:
            self.on_progress("decode", sum(len(r.gen.decoded.tokens) for r in self.rows), total)

    def result(self, row: Row) -> None:
        g = row.gen
        stats = generation_stats(
            prompt_tokens=len(row.tokens), cached=row.cached, source=row.source, prefilled=row.prefilled,
            lookup_s=row.lookup_s, prefill_s=row.prefill_s, t0=self.t0, token_times=g.times,
            decode_tokens=len(g.decoded.tokens), finish_reason=g.decoded.finish_reason,
            peak_memory=int(mx.get_peak_memory()) if hasattr(mx, "get_peak_memory") else None,
        )
        stats.update(batch_index=row.index, batch_rows=len(self.rows), batch_shared_tokens=row.shared,
                     batch_mode=self.mode, **(g.proposers if self.mode == "serial" else row.drafts).lookup_stats(
                         g.req.lookup))
        stats["truncated_tokens"] = g.req.truncated
        parsed = g.constrained(stats)
        self.services.metrics.record(self.ns, stats)
        logprobs = g.decoded.logprobs if g.req.params.logprobs is not None else None
        row.result = GenerationResult(g.stream.text, list(g.decoded.tokens), stats, list(row.tokens), logprobs, parsed)
        self.services.events.emit("generation", **{k: v for k, v in stats.items() if not isinstance(v, (list, dict))})
        if self.on_row is not None:
            self.on_row(row.index, row.result)
