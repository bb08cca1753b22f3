"""Prefill, decode, streaming text and stop conditions: the token loop.

Tokens are drawn by the (seed, step) samplers of sampling.py, so a
generation restored at step k continues exactly as the uninterrupted run
would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from .logprobs import log_softmax, pick, read
from .sampling import SamplingParams, sample


def prefill(
    model,
    caches: list,
    tokens: Sequence[int],
    *,
    chunk: int,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Forward `tokens` into `caches` in chunks (no logits are kept)."""
    total = len(tokens)
    for start in range(0, total, chunk):
        model(mx.array(tokens[start : start + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
        if progress is not None:
            progress(min(start + chunk, total), total)


@dataclass
class DecodeResult:
    tokens: list = field(default_factory=list)  # emitted token ids
    logprobs: list = field(default_factory=list)  # TokenLogprob per emitted token, when asked for
    forwarded: int = 0  # how many emitted tokens the caches hold
    finish_reason: str = "length"  # length | eos | stop | interrupted


def decode(
    model,
    caches: list,
    pending: Sequence[int],
    params: SamplingParams,
    *,
    eos_ids: set,
    first_step: int = 0,
    on_token: Callable[[int, int], bool] | None = None,
    into: DecodeResult | None = None,
    sync_at: Callable[[int], bool] | None = None,
) -> DecodeResult:
    """Forward `pending` (the tokens not yet in the caches) and sample until done.

    Pipelined like mlx-lm: step i+1 is queued before token i is read, so the
    caches may hold one emitted token more than a plain loop would;
    `forwarded` says exactly how many. `on_token(token, step)` returns True to
    stop. Step numbers start at `first_step` (resume). Results accumulate in
    `into` when given, so a caller still sees them after an interrupt.
    At steps where `sync_at(step)` is true nothing is queued ahead: during
    that step's `on_token` the caches hold exactly the tokens before it (a
    boundary any cache kind can capture without cutting).
    """

    def forward(inputs: mx.array, step: int) -> tuple:
        logits = model(inputs, cache=caches)[:, -1, :]
        y = sample(logits, params, step)
        picked = pick(log_softmax(logits), y, params.logprobs) if params.logprobs is not None else None
        return y, picked

    result = into if into is not None else DecodeResult()
    remaining = params.max_tokens - first_step
    y, picked = forward(mx.array(list(pending))[None], first_step)
    mx.eval(_arrays((y, picked)))
    step = first_step
    try:
        while True:
            last = len(result.tokens) + 1 >= remaining
            next_y = None
            # From the second token on, step i+1 is queued before token i is
            # read (as mlx-lm does). Not for the first token: on the CPU,
            # queueing a step costs most of a step, and TTFT would pay it.
            if result.tokens and not last and not (sync_at is not None and sync_at(step)):
                next_y = forward(y[:, None], step + 1)
                mx.async_eval(_arrays(next_y))
                result.forwarded += 1
            token = y.item()
            result.tokens.append(token)
            if picked is not None:
                result.logprobs += read([token], picked)
            if token in eos_ids:
                result.finish_reason = "eos"
                break
            if on_token is not None and on_token(token, step):
                result.finish_reason = "stop"
                break
            if last:
                result.finish_reason = "length"
                break
            if next_y is None:
                next_y = forward(y[:, None], step + 1)
                mx.async_eval(_arrays(next_y))
                result.forwarded += 1
            y, picked = next_y
            step += 1
    except KeyboardInterrupt:
        result.finish_reason = "interrupted"
        raise
    finally:
        mx.eval([c.state for c in caches])
    return result


def _arrays(step: tuple) -> list:
    """The arrays of a step's (token, picked log-probabilities)."""
    y, picked = step
    return [y] + [a for a in (picked or ()) if a is not None]


class TextStream:
    """Incremental detokenization with stop strings.

    `add(token)` returns the newly visible text (held back while it could be
    the start of a stop string) and sets `stopped` when a stop string appears.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stop = tuple(stop)
        self.emitted = ""
        self.stopped = False

    def _full(self) -> str:
        return self.detok.text

    def add(self, token: int) -> str:
        self.detok.add_token(token)
        return self._advance(self._full())

    def finish(self) -> str:
        self.detok.finalize()
        return self._advance(self._full(), final=True)

    def _advance(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                text, self.stopped = text[:i], True
        visible = text
        if not self.stopped and not final:  # hold back a possible stop-string start
            hold = max(
                (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                default=0,
            )
            visible = text[: len(text) - hold]
        new = visible[len(self.emitted) :] if visible.startswith(self.emitted) else ""
        self.emitted = visible if visible.startswith(self.emitted) else self.emitted
        return new

    @property
    def text(self) -> str:
        return self.emitted
