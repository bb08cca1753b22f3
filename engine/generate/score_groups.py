"""Scoring many (context, continuation) pairs at once (`Engine.score_groups`: what lm-eval's
`loglikelihood` asks), with what the contexts share computed once.

Pairs with the same context tokens are one question, their continuations its choices. Sorted by
their tokens (a trie's order), questions that share at least MIN_SHARED leading tokens (a task's
few-shot block) form a family, whose shared prefix comes from the cache or is prefilled once and
published. Then, a wave of questions at a time: each question starts from the family's prefix (or
from a longer prefix the cache holds: a rerun, after a restart from SSD), the rest of its context
but its last token is prefilled with the wave's other questions in one left-padded forward that
attends to the prefix once (batch/shared.py `LentRows`), and its state is published; then every
choice of the wave is scored in one forced forward over those states (scoring.py `score_over`:
the family's prefix attended once for all rows, each question's own positions in its rows'
tails). Models whose caches cannot share a prefix across rows score question by question
(scoring.py `score_rows`: the cache still serves what it can).
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Callable, Sequence

from ..kv.caches import new_caches, shares_prefix
from ..kv.cascade import Unroutable, routing
from ..kv.checkpoint import Checkpoint
from ..kv.tokens import as_token_array, common_prefix_len
from .batch.shared import LentRows
from .prefill import prefill
from .sampling import GenerationError
from .scoring import ScoreResult, check, encode_pairs, score_over, score_rows

MIN_SHARED = 16  # questions that share fewer leading tokens are families of their own
WAVE_ROWS = 32  # choices scored in one forward (a wave holds whole questions: at least one)


def score_groups(services, model, pairs: Sequence, *, use_cache: bool,
                 on_progress: Callable[[str, int, int], None] | None = None) -> list[ScoreResult]:
    """Engine.score_groups: the pairs checked and tokenized, grouped, scored; one result each, in order."""
    if model.vision is not None:
        raise GenerationError(f"score: model {model.name!r} is a vision-language model: score text models")
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise GenerationError("score_groups: give a list of (context, continuation) pairs")
    encoded = encode_all(model.tokenizer, pairs)
    questions: dict[tuple, list[int]] = {}
    for i, (ctx, cont) in enumerate(encoded):
        check(ctx, [cont], model, [f"pair {i}"])
        questions.setdefault(tuple(ctx), []).append(i)
    run = _Run(services, model, [c for _, c in encoded], use_cache and model.cache_notice is None, on_progress)
    with services.cache.generating():
        run.all(sorted(questions.items()))
    services.events.emit("score", model=model.name, continuations=len(pairs), questions=len(questions),
                         prefilled=run.prefilled)
    return [ScoreResult(pair[1], cont, float(sum(lps)), lps, greedy, stats)
            for pair, (_, cont), (lps, greedy), stats in zip(pairs, encoded, run.results, run.stats)]


def encode_all(tokenizer, pairs: Sequence) -> list[tuple]:
    """(context ids, continuation ids) of each pair, tokenized as `Engine.score` does (a context's
    encoding computed once however many pairs it starts)."""
    encode = lru_cache(maxsize=1024)(lambda text: tuple(tokenizer.encode(text)))
    out = []
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise GenerationError(f"score_groups: pair {i} is not a (context, continuation) pair")
        try:
            ctx, [cont] = encode_pairs(encode, pair[0], [pair[1]])
        except GenerationError as e:
            raise GenerationError(f"pair {i}: {e}") from None
        out.append((ctx, cont))
    return out


def families(questions: list) -> list[tuple[int, list]]:
    """Sorted (context, pair indices) as (shared prefix length, questions) runs sharing at least
    MIN_SHARED tokens; every question keeps its context's last token out of the prefix."""
    out: list[tuple[int, list]] = []
    for q in questions:
        ctx = q[0]
        if out:
            shared, members = out[-1]
            n = min(shared, common_prefix_len(as_token_array(members[-1][0]), as_token_array(ctx)), len(ctx) - 1)
            if n >= MIN_SHARED:
                members.append(q)
                out[-1] = (n, members)
                continue
        out.append((len(ctx) - 1, [q]))
    return out


def waves(questions: list) -> list[list]:
    """Whole questions, as many as fit WAVE_ROWS choices (at least one)."""
    out, rows = [], 0
    for q in questions:
        if not out or rows + len(q[1]) > WAVE_ROWS:
            out.append([])
            rows = 0
        out[-1].append(q)
        rows += len(q[1])
    return out


class _Run:
    """One score_groups call: results (token log-probabilities, greedy) and stats, per pair."""

    def __init__(self, services, model, conts: list, use_cache: bool, on_progress):
        self.services, self.model, self.conts, self.use_cache = services, model, conts, use_cache
        self.cache, self.ns, self.chunk = services.cache, model.namespace, services.prefill_chunk
        self.on_progress = on_progress
        self.results: list = [None] * len(conts)
        self.stats: list = [None] * len(conts)
        self.done = self.prefilled = 0

    def all(self, questions: list) -> None:
        if shares_prefix(new_caches(self.model.model)):
            with routing(self.model.model) as routed:
                if routed:
                    try:
                        for shared, family in families(questions):
                            self._family(shared, family)
                        return
                    except Unroutable:
                        pass
        for ctx, idx in questions:  # one question after another (those not scored yet)
            if self.results[idx[0]] is None:
                rows, stats = score_rows(self.services, self.model, list(ctx), [self.conts[i] for i in idx],
                                         use_cache=self.use_cache)
                self.prefilled += stats["context_tokens"] - 1 - stats["cached_tokens"]
                self._record(idx, rows, stats)

    def _record(self, idx: list, rows: list, stats: dict) -> None:
        for i, row in zip(idx, rows):
            self.results[i], self.stats[i] = row, stats
        self.done += len(idx)
        if self.on_progress is not None:
            self.on_progress("score", self.done, len(self.results))

    def _prefilled(self, tokens: int, since: float) -> None:
        self.prefilled += tokens
        self.services.metrics.record_prefill(self.ns, tokens, time.perf_counter() - since)

    def _family(self, shared: int, questions: list) -> None:
        loans = []
        try:
            root = self._root(questions[0][0][:shared], loans)
            for wave in waves(questions):
                self._wave(shared, root, wave)
        finally:
            for loan in loans:
                loan.release()

    def _root(self, prefix: tuple, loans: list) -> tuple | None:
        """The family's shared prefix: (its Checkpoint, how many of its tokens came from the cache,
        from which tier), the rest prefilled once (and published)."""
        if not prefix:
            return None
        loan = self.cache.take(list(prefix) + [-1], self.ns) if self.use_cache else None  # (-1: all of it at most)
        if loan is not None:
            loans.append(loan)
        cached = loan.length if loan is not None else 0
        caches = loan.caches if loan is not None else self.model.new_caches()
        if cached < len(prefix):
            t = time.perf_counter()
            prefill(self.model.forward, caches, prefix[cached:], chunk=self.chunk)
            self._prefilled(len(prefix) - cached, t)
        cp = Checkpoint.capture(prefix, caches)
        if self.use_cache and cached < len(prefix):
            self.cache.put(cp, self.ns)
        return cp, cached, loan.source if loan is not None else None

    def _start(self, ctx: tuple, shared: int, root: tuple | None, loans: list) -> tuple:
        """(lent caches or None, positions they hold, how many came from the cache, from which tier)
        for one question: a longer prefix than the family's from the cache, else the family's."""
        loan = self.cache.take(ctx, self.ns) if self.use_cache else None  # (at most len(ctx) - 1)
        if loan is not None and (loan.length > shared or root is None):
            loans.append(loan)
            return loan.caches, loan.length, loan.length, loan.source
        if loan is not None:
            loan.release()
        return (root[0].lend(shared), shared, *root[1:]) if root is not None else (None, 0, 0, None)

    def _wave(self, shared: int, root: tuple | None, wave: list) -> None:
        loans: list = []
        try:
            starts = [self._start(ctx, shared, root, loans) for ctx, _ in wave]
            rests = [list(ctx[start[1]:-1]) for (ctx, _), start in zip(wave, starts)]
            states = self._prefill([ctx for ctx, _ in wave], starts, rests)
            lent, inputs, conts = [], [], []
            for (ctx, idx), cp in zip(wave, states):
                for i in idx:
                    lent.append(cp.lend() if cp is not None else None)
                    inputs.append([ctx[-1]] + self.conts[i][:-1])
                    conts.append(self.conts[i])
            rows = score_over(self.model, lent, inputs, conts, self.chunk)
            at = 0
            for (ctx, idx), (_, _, cached, source) in zip(wave, starts):
                stats = {"context_tokens": len(ctx), "cached_tokens": cached, "source": source,
                         "shared_tokens": shared, "mode": "grouped"}
                self._record(idx, rows[at : at + len(idx)], stats)
                at += len(idx)
        finally:
            for loan in loans:
                loan.release()

    def _prefill(self, contexts: list, starts: list, rests: list) -> list:
        """Each question's state before its last token (a Checkpoint, or None for none): the
        rests prefilled together over what each started from; a new state published."""
        todo = [b for b, r in enumerate(rests) if r]
        states = [Checkpoint.capture(ctx[:-1], caches) if caches is not None and not rest else None
                  for ctx, (caches, *_), rest in zip(contexts, starts, rests)]
        if not todo:
            return states
        rows = LentRows(self.model, [starts[b][0] for b in todo])
        rows.seed([len(rests[b]) for b in todo])
        t = time.perf_counter()
        rows.prefill(self.model.model, [rests[b] for b in todo], self.chunk)
        self._prefilled(sum(len(rests[b]) for b in todo), t)
        self.services.memory.check("prefill")
        for pos, b in enumerate(todo):
            n = len(contexts[b]) - 1
            states[b] = Checkpoint.of_layers(contexts[b][:-1], rows.layers_of(pos, pos, n))
            if self.use_cache:
                self.cache.put(states[b], self.ns)
        return states
