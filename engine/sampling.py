"""Sampling: the parameters every generation path takes, and samplers whose state is (seed, step).

The key for step i depends only on the seed and i, so a generation restored
at step k (a resume, a batch row, a speculative verification) draws exactly
what the uninterrupted run would have.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
