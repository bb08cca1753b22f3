"""Scoring given continuations of one context (`Engine.score`): the log-likelihood of each, as
lm-eval's `loglikelihood` computes it, with the context prefilled once.

Tokenization is lm-eval's: trailing whitespace of the context moves to the continuation, the
continuation's tokens are those of the whole string past the context's own encoding, and they are
conditioned on the context's encoding. The context but its last token comes from the cache (or is
prefilled once and published); then every continuation's tokens, after the context's last token,
go in one batched forward over that shared prefix (kv/cascade.py: the prefix attended to once for
all of them); each position's log-softmax gives the next token's log-probability. With quantized KV
from kv_start on, each row converts at exactly kv_start at its own column of the left-padded batch,
or starts converted over a context past it (kv/cascade_quantized.py). Models whose caches cannot
share a prefix across rows score one continuation after another, each over a loan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from .prefill import prefill
from ..kv.caches import new_caches, shares_prefix
from ..kv.cascade import Unroutable, routing
from ..kv.checkpoint import Checkpoint
from .batch.shared import LentRows, SharedRows
from .loop import OneRow, Row, run as run_rows
from ..chat.prompts import bounded, encodable, render_turn
from .sampling import GenerationError, SamplingParams
from .window import check_truncate, fit


@dataclass
class ScoreResult:
    continuation: object  # as given: text or token ids
    tokens: list  # the continuation's token ids
    logprob: float  # their log-likelihood given the context (a sum)
    token_logprobs: list = field(default_factory=list)  # one per token
    greedy: bool = False  # every token the model's most likely one
    stats: dict = field(default_factory=dict, repr=False)

    @property
    def mean_logprob(self) -> float:
        return self.logprob / max(len(self.tokens), 1)


def score(services, model, context, continuations, *, raw: bool, system: str | None,
          use_cache: bool, on_progress=None, truncate: str | None = None) -> list[ScoreResult]:
    """Engine.score: the inputs checked and tokenized (a context too long for the window cut as
    `truncate` says, for the longest continuation: window.py), the rows scored, one result each."""
    if model.vision is not None:
        raise GenerationError(f"score: model {model.name!r} is a vision-language model: score text models")
    if isinstance(continuations, (str, bytes)) or not isinstance(continuations, Sequence) or not continuations:
        raise GenerationError("score: continuations are a non-empty list (of strings, or of token-id lists)")
    tok = model.tokenizer
    if isinstance(context, str):  # (a context of more characters than the window could hold: before tokenizing)
        context = bounded(encodable(context, "score: the context"), model.config, truncate, "score: the context")
    encodable(system, "score: the system prompt")
    for i, c in enumerate(continuations):
        encodable(c if isinstance(c, str) else None, f"score: continuation {i}")
    if raw:
        encode = tok.encode
    else:
        context = render_turn(tok, context, system=system) if isinstance(context, str) else context
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    ctx, conts = encode_pairs(encode, context, list(continuations))
    if check_truncate(truncate) is not None and conts and all(conts):  # (an empty one: check says so)
        ctx, _ = fit(model, ctx, max(map(len, conts)) - 1, truncate, what="score: the context",
                     room_name="the longest continuation's positions")  # (each continuation's but its last)
    check(ctx, conts, model)
    t0 = time.perf_counter()
    with services.cache.generating():
        rows, stats = score_rows(services, model, ctx, conts, use_cache=use_cache and model.cache_notice is None,
                                 progress=on_progress)
    stats["seconds"] = time.perf_counter() - t0
    services.events.emit("score", model=model.name, continuations=len(conts), **stats)
    return [ScoreResult(c, ids, float(sum(lps)), lps, greedy, stats)
            for c, ids, (lps, greedy) in zip(continuations, conts, rows)]


def encode_pairs(encode, context, continuations: list) -> tuple[list, list]:
    """(the context's token ids, each continuation's token ids) the lm-eval way (`encode`: text to
    ids); token ids pass through."""
    if isinstance(context, str):
        if not context:
            raise GenerationError("score: the context is empty (give it at least one token)")
        pairs = []
        for i, cont in enumerate(continuations):
            if not isinstance(cont, str):
                raise GenerationError(f"continuation {i}: give strings with a string context, not {type(cont).__name__}")
            ctx = context
            spaces = len(ctx) - len(ctx.rstrip())
            if spaces:  # lm-eval: "the cat sat " + "on" scores " on" after "the cat sat"
                cont, ctx = ctx[-spaces:] + cont, ctx[:-spaces]
            whole, head = list(encode(ctx + cont)), list(encode(ctx))
            pairs.append((head, whole[len(head):]))
        ctx_ids = pairs[0][0] if pairs else list(encode(context))
        if any(h != ctx_ids for h, _ in pairs):  # (only when some continuations move spaces and others not)
            raise GenerationError("score: continuations disagree on where the context ends; strip its trailing spaces")
        return ctx_ids, [c for _, c in pairs]
    ctx_ids = _ids(context, "the context")
    return ctx_ids, [_ids(c, f"continuation {i}") for i, c in enumerate(continuations)]


def _ids(x, what: str) -> list:
    if isinstance(x, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        raise GenerationError(f"score: {what}: token ids (a list of ints) with a token-id context")
    return [int(t) for t in x]


def check(ctx: list, conts: list, model, names: list | None = None) -> None:
    """Errors for an empty context or continuation, or a sequence the model cannot attend over
    (it forwards the context and the continuation but its last token). names: what to call each
    continuation in an error (default "continuation i")."""
    if not ctx:
        raise GenerationError("score: the context is empty (give it at least one token)")
    window = model.context_window
    for i, c in enumerate(conts):
        name = names[i] if names else f"continuation {i}"
        if not c:
            raise GenerationError(f"score: {name} is empty (no tokens after the context)")
        if window and len(ctx) + len(c) - 1 > window:
            raise GenerationError(f"score: {name} makes {len(ctx) + len(c)} tokens, {len(ctx) + len(c) - 1} "
                                  f"forwarded: past the model's context window of {window}"
                                  + ("" if names else " (shorten the context, or truncate='left' or 'middle' cuts it)"))


def score_rows(services, model, ctx: list, conts: list, *, use_cache: bool, progress=None) -> tuple[list, dict]:
    """Each continuation's token log-probabilities and whether each token was the argmax
    (progress(phase, done, total): a restore, the context's prefill)."""
    cache, ns = services.cache, model.namespace
    loan = cache.take(ctx, ns, progress=progress) if use_cache else None  # at most len(ctx) - 1 tokens
    try:
        prefix_len = len(ctx) - 1
        cached = loan.length if loan is not None else 0
        caches = loan.caches if loan is not None else model.new_caches()
        if cached < prefix_len:  # the context's rest, once for every continuation
            t = time.perf_counter()
            prefill(model.forward, caches, ctx[cached:prefix_len], chunk=services.prefill_chunk,
                    progress=progress and (lambda done, total: progress("prefill", done, total)))
            services.metrics.record_prefill(ns, prefix_len - cached, time.perf_counter() - t)
        inputs = [[ctx[-1]] + c[:-1] for c in conts]
        stats = {"context_tokens": len(ctx), "cached_tokens": cached, "source": loan.source if loan else None,
                 "prefilled_tokens": max(0, prefix_len - cached)}
        # every layer plain KV in the model's own form: quantized KV too (the rows cache converts
        # each row at exactly kv_start, at its own column; the live caches may be quantized already)
        if prefix_len and shares_prefix(new_caches(model.model)):
            cp = Checkpoint.capture(ctx[:prefix_len], caches)
            if use_cache and cached < prefix_len:  # (past kv_start its layers serve only lengths >= start)
                cache.put(cp, ns)
            with routing(model.model) as routed:
                if routed:
                    try:
                        return _batched(model, cp, inputs, conts, services.prefill_chunk), {**stats, "mode": "batched"}
                    except Unroutable:
                        pass
            return [_one(model, cp.lend(prefix_len), x, c) for x, c in zip(inputs, conts)], {**stats, "mode": "serial"}
        if prefix_len == 0:
            return [_one(model, model.new_caches(), x, c) for x, c in zip(inputs, conts)], {**stats, "mode": "serial"}
        cp = Checkpoint.capture(ctx[:prefix_len], caches, copy=True)
        return [_one(model, cp.lend(prefix_len), x, c) for x, c in zip(inputs, conts)], {**stats, "mode": "serial"}
    finally:
        if loan is not None:
            loan.release()


def _batched(model, cp: Checkpoint, inputs: list, conts: list, chunk: int) -> list:
    """Every continuation in one left-padded forward over the context (in chunks of `chunk`
    columns), through the token loop's forced rows."""
    return score_over(model, [cp.lend(len(cp.tokens)) for _ in inputs], inputs, conts, chunk)


def score_over(model, lent: list, inputs: list, conts: list, chunk: int) -> list:
    """Forced rows, row b over the caches lent[b] (or none) fed inputs[b] and scored on conts[b],
    all in one left-padded forward: rows lent one prefix attend to it once (batch/shared.py
    `LentRows`; a quantized prefix, past kv_start, is lent quantized: its rows start converted)."""
    rows = LentRows(model, lent)
    rows.seed([len(x) for x in inputs])
    forced = [_forced_row(x, c) for x, c in zip(inputs, conts)]
    run_rows(forced, SharedRows(model.model, rows.layers, len(forced)), chunk=chunk)
    return [_read(r) for r in forced]


def _one(model, caches: list, inputs: list, cont: list) -> tuple:
    row = _forced_row(inputs, cont)
    run_rows([row], OneRow(model.forward, caches))
    return _read(row)


def _forced_row(inputs: list, cont: list) -> Row:
    """A row of the token loop that feeds the context's last token and the continuation, keeping them all."""
    return Row(SamplingParams(max_tokens=len(cont)), inputs[:1], eos_ids=set(), forced=cont)


def _read(row: Row) -> tuple:
    """(token log-probabilities, greedy) of a forced row."""
    return [t.logprob for t in row.out.logprobs], bool(row.out.greedy)
