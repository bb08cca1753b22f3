"""Cutting caches back after a speculative verify forward, exactly, for every cache kind.

Plain and quantized KV are trimmed. Other kinds (a sliding window that may wrap, recurrent
state, chunked attention, lists of them) cannot be cut back: mlx-lm's `trim_prompt_cache`
then trims nothing and returns 0, and its speculative decoding goes on from a wrong state
(mlx-lm 0.32.2). Here their state is saved before the forward (new handles on the same arrays:
MLX's in-place updates replace an array's contents, never a handle's, so nothing is copied
unless the forward writes), restored after it, and the kept tokens are forwarded again.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from ..kv.codecs import CODECS, kind_of


def _handle(v: Any) -> Any:
    if isinstance(v, mx.array):
        return mx.array(v)  # a new handle: a later in-place write to `v` leaves it as it is
    if isinstance(v, (list, tuple)):
        return type(v)(_handle(x) for x in v)
    if kind_of(v) in CODECS:
        return _Saved(v)
    return v


def _put_back(v: Any) -> Any:
    if isinstance(v, _Saved):
        v.restore()
        return v.cache
    if isinstance(v, (list, tuple)):
        return type(v)(_put_back(x) for x in v)
    return v


class _Saved:
    """The attributes of one live cache (nested caches of a list kind included), as they were."""

    def __init__(self, cache):
        self.cache = cache
        self.attrs = {k: _handle(v) for k, v in vars(cache).items()}

    def restore(self) -> None:
        for k, v in self.attrs.items():
            setattr(self.cache, k, _put_back(v))
        self.attrs = {k: _handle(v) for k, v in vars(self.cache).items()}  # restorable again


def cuttable(c) -> bool:
    return kind_of(c) in CODECS and CODECS[kind_of(c)].always_cuttable


class Rewind:
    """Keeps `caches` able to go back to their state before the next forward.

    `mark(T)` before a forward of tokens T; `keep(n)` afterwards leaves the caches holding
    what they held before plus T[:n]: trimmed, or restored and T[:n] forwarded again."""

    def __init__(self, forward: Callable, caches: list):
        self.forward, self.caches = forward, caches
        self.exact = [c for c in caches if not cuttable(c)]
        self.saved: list = []
        self.tokens: list = []
        self.held = 0  # how many of `tokens` the caches hold
        self.recomputed = 0  # tokens forwarded again after a restore

    def mark(self, tokens: Sequence[int]) -> None:
        self.tokens, self.held = list(tokens), len(tokens)
        if self.exact:
            self.saved = [_Saved(c) for c in self.exact]

    def restore(self, since: int) -> None:
        """Back to the mark; `since`: the tokens the caches took after it."""
        for s in self.saved:
            s.restore()
        for c in self.caches:
            if cuttable(c):
                c.trim(since)

    def keep(self, n: int) -> None:
        if n >= self.held:
            return
        if not self.exact:
            for c in self.caches:
                c.trim(self.held - n)
        else:
            self.restore(self.held)
            if n:
                self.forward(mx.array(self.tokens[:n])[None], cache=self.caches)
                mx.eval([c.state for c in self.caches])
                self.recomputed += n
        self.held = n
