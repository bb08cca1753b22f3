"""Prefill, seeded decode, streaming text and stop conditions.

The sampler's state is (seed, step): the key for step i depends only on the
seed and i, so a generation restored at step k continues exactly as the
uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from mlx_lm.sample_utils import apply_top_k, apply_top_p


class GenerationError(ValueError):
    """Bad generation input, with a message naming the problem."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple = ()

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise GenerationError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise GenerationError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise GenerationError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if vocab_size is not None and self.top_k >= vocab_size:
            raise GenerationError(f"top_k must be below the vocabulary size {vocab_size}, got {self.top_k}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise GenerationError(f"seed must be an integer >= 0, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise GenerationError("stop strings must be non-empty strings")
        return self

    def as_dict(self) -> dict:
        d = asdict(self)
        d["stop"] = list(self.stop)
        return d


def _mix64(x: int) -> int:
    """SplitMix64 finalizer: decorrelates (seed, step) pairs."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def step_key(seed: int, step: int) -> mx.array:
    return mx.random.key(_mix64(_mix64(seed) ^ step) & 0x7FFFFFFFFFFFFFFF)


def sample(logits: mx.array, params: SamplingParams, step: int) -> mx.array:
    """One token id (shape (1,)) from last-position logits of shape (1, vocab)."""
    if params.temperature == 0:
        return mx.argmax(logits, axis=-1)
    return sample_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), params, step)


def sample_logprobs(logprobs: mx.array, params: SamplingParams, step: int) -> mx.array:
    """`sample` from normalized log-probabilities (what mlx-lm's batch samplers are given)."""
    if params.temperature == 0:
        return mx.argmax(logprobs, axis=-1)
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return mx.random.categorical(logprobs * (1 / params.temperature), key=step_key(params.seed, step))


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

    def forward(inputs: mx.array, step: int) -> mx.array:
        logits = model(inputs, cache=caches)[:, -1, :]
        return sample(logits, params, step)

    result = into if into is not None else DecodeResult()
    remaining = params.max_tokens - first_step
    y = forward(mx.array(list(pending))[None], first_step)
    mx.eval(y)
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
                mx.async_eval(next_y)
                result.forwarded += 1
            token = y.item()
            result.tokens.append(token)
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
                mx.async_eval(next_y)
                result.forwarded += 1
            y = next_y
            step += 1
    except KeyboardInterrupt:
        result.finish_reason = "interrupted"
        raise
    finally:
        mx.eval([c.state for c in caches])
    return result


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
