"""How sure the model was: each token's log-probability under the model's distribution (the raw
logits' log-softmax, before temperature, top-p or top-k, as mlx-lm's `generate_step` reports it),
with the K most likely alternatives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx

MAX_TOP = 20  # alternatives per token at most


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: list = field(default_factory=list)  # (token id, log-probability), most likely first

    def as_dict(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "top": [list(t) for t in self.top]}


def log_softmax(logits: mx.array) -> mx.array:
    """float32 log-probabilities over the last axis."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def pick(logprobs: mx.array, tokens: mx.array, k: int) -> tuple:
    """For rows of `logprobs` (n, vocab) and the token of each row: (their log-probabilities, the
    top-k ids, their log-probabilities); lazy arrays, read with `read`."""
    chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1), axis=-1)[:, 0]
    if not k:
        return chosen, None, None
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return chosen, mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)


def read(tokens: list[int], picked: tuple) -> list[TokenLogprob]:
    chosen, ids, vals = picked
    chosen = chosen.tolist()
    if ids is None:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    # (a constraint's forbidden tokens, at -inf, are no alternatives)
    return [TokenLogprob(t, lp, [(a, b) for a, b in zip(i, v) if b > -math.inf])
            for t, lp, i, v in zip(tokens, chosen, ids.tolist(), vals.tolist())]
