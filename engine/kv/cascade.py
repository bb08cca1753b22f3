"""Rows that share a prefix attend to it once: shared-prefix batch attention (Hydragen, cascade attention).

A batch of rows holds, per layer, one `RowsCache`: each group of rows on the same cached prefix
keeps that prefix's keys and values once (the lent segments, joined once per batch only if the
prefix is in several pieces), and every row's own positions sit in one left-padded tail buffer
(rows, heads, T, dim): no copy of a prefix per row, no padding of a row to another's prefix.

Attention splits at the prefix boundary. Against a group's prefix, the queries of all its rows are
one matrix product (the rows become queries: the prefix is read once a step, not once per row);
each row attends to its own tail apart; the two parts merge by their softmax statistics
(max and sum of exponentials, in float32). A row without a shared prefix has a tail only.

Models call mlx-lm's `scaled_dot_product_attention(queries, keys, values, cache=...)`; `routing`
(around a batch, for the modules of that batch's model only) sends calls whose cache is a
`RowsCache` here and every other call to mlx-lm's own function, unchanged. A model that attends
to keys of its own making (MLA, its own softmax) is found out at its first call (`Unroutable`)
and its batch runs the other way (engine/generate/batch/run.py).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
from mlx_lm.models import base as lm_base

from .borrowed import STEP
from .caches import published_layer

_ORIGINAL = lm_base.scaled_dot_product_attention


class Unroutable(RuntimeError):
    """The model did not attend with the keys and values its cache returned."""


class RowsCache:
    """One layer of a batch: per group its prefix (keys, values) or None; per row its tail.

    A row's tail holds its own positions: first what it brought along (`seed`: the rest of what its
    loan held past the group's prefix), then the rest of its prompt, then what it decodes. All rows
    write at the same tail position each forward; what is not a row's (padding before a shorter row's
    tokens, `pad`; its rejected drafts, `cut`) is masked.
    """

    def __init__(self, prefixes: list, group_of: list[int]):
        """prefixes: per group, (keys, values) of shape (1, heads, P, dim), or None; group_of: per row."""
        self.prefixes, self.group_of = list(prefixes), list(group_of)
        self.prefix_len = [0 if self.prefixes[g] is None else int(self.prefixes[g][0].shape[2]) for g in group_of]
        self.origin = list(self.prefix_len)  # per row: its position at tail position 0
        self.holes: list[list] = [[] for _ in group_of]  # per row: tail intervals that are not its own
        self.tails: tuple = ()  # (keys, values) of shape (rows, heads, capacity, dim)
        self.T = 0  # tail positions written (padding included), the same for every row
        self._fetched = None
        self._converted: dict = {}  # group -> its prefix in float32

    @property
    def rows(self) -> int:
        return len(self.group_of)

    @property
    def offset(self) -> mx.array:
        """Each row's position of its next token (what RoPE takes)."""
        return mx.array([o + self.T for o in self.origin])

    def seed(self, seeds: list, rests: list[int]) -> None:
        """Before the first write: row b brings `seeds[b]` ((keys, values) of positions it already
        holds past its prefix, or None) and will prefill `rests[b]` tokens; left-aligned so every
        row's rest ends at the same tail position."""
        lengths = [0 if x is None else int(x[0].shape[2]) for x in seeds]
        S, R = max(lengths), max(rests)
        if S:
            like = next(x for x in seeds if x is not None)
            self._grow(S, like)
            for b, x in enumerate(seeds):
                if x is not None:
                    for buf, a in zip(self.tails, x):
                        buf[b : b + 1, :, S - lengths[b] : S, :] = a
            self.T = S
        for b, (s, r) in enumerate(zip(lengths, rests)):
            self.holes[b] = [iv for iv in ((0, S - s), (S, S + R - r)) if iv[1] > iv[0]]
            self.origin[b] = self.prefix_len[b] + s - (R - r) - S

    def pad(self, lengths: list[int]) -> None:
        """Before a forward of max(lengths) positions where row b brings lengths[b] tokens: its first
        positions are padding (left-aligned, as `seed` does), so every row's tokens end together."""
        L = max(lengths)
        for b, n in enumerate(lengths):
            if n < L:
                self.holes[b].append((self.T, self.T + L - n))
                self.origin[b] -= L - n

    def cut(self, row: int, n: int) -> None:
        """After a forward: row `row`'s last n positions are no longer its own (rejected drafts)."""
        if n > 0:
            self.holes[row].append((self.T - n, self.T))
            self.origin[row] -= n

    def _grow(self, n: int, like: tuple) -> None:
        self.tails = grown(self.tails, self.T, n, like, len(self.group_of))

    def _valid(self) -> mx.array:
        """(rows, T): which tail positions are each row's own."""
        valid = np.ones((len(self.group_of), self.T), dtype=bool)
        for b, holes in enumerate(self.holes):
            for a, z in holes:
                valid[b, a:z] = False
        return mx.array(valid)

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        self._grow(n, (keys, values))
        for buf, a in zip(self.tails, (keys, values)):
            buf[..., self.T : self.T + n, :] = a
        self.T += n
        self._fetched = tuple(t[..., : self.T, :] for t in self.tails)
        return self._fetched

    def make_mask(self, *args, **kwargs):
        return None  # (the attention builds its own from the padding)

    def is_trimmable(self):
        return False

    def size(self):
        return self.T

    @property
    def state(self):
        return self.tails

    def attend(self, queries, scale: float):
        """Attention of `queries` (rows, q_heads, L, dim) over each row's prefix and tail."""
        B, Hq, L, D = queries.shape
        Hkv = self.tails[0].shape[1]
        rep = Hq // Hkv
        q = (queries.astype(mx.float32) * scale).reshape(B, Hkv, rep, L, D)  # scores in float32
        parts = [self._attend_tail(q)]
        if any(self.prefix_len):  # some row has a prefix
            parts.append(self._attend_prefixes(q))
        m = parts[0][0] if len(parts) == 1 else mx.maximum(parts[0][0], parts[1][0])
        num, den = None, None
        for pm, pl, po in parts:
            w = mx.exp(pm - m)
            num = po * w if num is None else num + po * w
            den = pl * w if den is None else den + pl * w
        out = (num / mx.where(den == 0, 1.0, den)).astype(queries.dtype)  # (B, Hkv, rep, L, Dv); padding: 0
        return out.reshape(B, Hq, L, -1)

    def _attend_tail(self, q):
        """Each row against its own tail: (max, sum, unnormalized output), float32."""
        k, v = (t[..., : self.T, :] for t in self.tails)
        scores = q @ mx.expand_dims(mx.swapaxes(_f32(k), -1, -2), 2)  # (B, Hkv, rep, L, T)
        L = q.shape[3]
        pos = mx.arange(self.T)
        valid = self._valid()  # (B, T): not padding
        causal = pos[None, :] <= mx.arange(self.T - L, self.T)[:, None]  # (L, T)
        mask = valid[:, None, None, None, :] & causal[None, None, None, :, :]
        scores = mx.where(mask, scores, -mx.inf)
        m = mx.max(scores, axis=-1, keepdims=True)
        m = mx.where(mx.isinf(m), 0.0, m)  # a row with no tail position yet (all padding)
        p = mx.exp(scores - m)
        return m, mx.sum(p, axis=-1, keepdims=True), p @ mx.expand_dims(_f32(v), 2)

    def _attend_prefixes(self, q):
        """Every group's rows against its prefix as one product; rows without one get nothing."""
        B, Hkv, rep, L, D = q.shape
        m = mx.full((B, Hkv, rep, L, 1), -mx.inf)
        s = mx.zeros((B, Hkv, rep, L, 1))
        o = None
        for rows, (k, v) in self._prefix_parts():
            idx = mx.array(rows)
            qg = mx.swapaxes(q[idx], 0, 1).reshape(1, Hkv, len(rows) * rep * L, D)  # the rows as queries
            scores = qg @ mx.swapaxes(k, -1, -2)  # (1, Hkv, rows*rep*L, P)
            gm = mx.max(scores, axis=-1, keepdims=True)
            p = mx.exp(scores - gm)
            gs, go = mx.sum(p, axis=-1, keepdims=True), p @ v
            back = lambda a: mx.swapaxes(a.reshape(Hkv, len(rows), rep, L, a.shape[-1]), 0, 1)
            if o is None:
                o = mx.zeros((B, Hkv, rep, L, go.shape[-1]), go.dtype)
            m[idx], s[idx], o[idx] = back(gm), back(gs), back(go)
        if o is None:  # the rows of every prefix left the batch: nothing to add
            o = mx.zeros((B, Hkv, rep, L, self.tails[1].shape[-1]), mx.float32)
        return m, s, o

    def _prefix_parts(self):
        """(rows, their prefix's keys and values in float32) for every group with a prefix."""
        for g, prefix in enumerate(self.prefixes):
            rows = [i for i, x in enumerate(self.group_of) if x == g]
            if prefix is not None and rows:
                yield rows, self._prefix32(g)

    def _prefix32(self, g: int) -> tuple:
        """Group g's prefix in float32 (a float32 model's own arrays; another dtype's converted
        once for the batch: no score is rounded below float32)."""
        if g not in self._converted:
            self._converted[g] = tuple(_f32(a) for a in self.prefixes[g])
        return self._converted[g]

    def keep(self, rows: list[int]) -> None:
        """Only these rows go on (in this order): finished rows leave the batch."""
        idx = mx.array(rows)
        for name in ("group_of", "prefix_len", "origin", "holes"):
            setattr(self, name, [getattr(self, name)[i] for i in rows])
        self.tails = tuple(t[idx] for t in self.tails) if self.tails else ()

    def own_length(self, row: int) -> int:
        """How many tail positions are row `row`'s own."""
        return self.T - sum(min(z, self.T) - a for a, z in self.holes[row] if a < self.T)

    def row_tail(self, row: int, upto: int | None = None, arrays: tuple | None = None) -> tuple:
        """Row `row`'s own positions (the first `upto` of them) of the tails (or of `arrays`, laid out
        as they are) as arrays of shape (1, heads, n, ...): copies."""
        arrays = self.tails if arrays is None else arrays
        if not arrays:
            return ()
        own = np.flatnonzero(np.array(self._valid()[row]))
        own = own[:upto] if upto is not None else own
        idx = mx.array(own)
        return tuple(mx.array(t[row : row + 1, :, :, :][:, :, idx, :]) for t in arrays) if len(own) else ()

    def published(self, like, row: int, lent: list, n: int):
        """Row `row`'s layer of n positions, of `like`'s kind: the lent segments, then its own."""
        return published_layer(like, lent, self.row_tail(row, n - self.prefix_len[row]), n)


def grown(buffers: tuple, T: int, n: int, like: tuple, rows: int) -> tuple:
    """`buffers` (rows, heads, capacity, ...) with room for n positions past T (whole steps, as
    mlx-lm's KVCache grows); new ones shaped as `like` when there are none."""
    if buffers and T + n <= buffers[0].shape[2]:
        return buffers
    room = (STEP + n - 1) // STEP * STEP
    pads = [mx.zeros((rows, a.shape[1], room, a.shape[3]), a.dtype) for a in like]
    return tuple(mx.concatenate([t[..., :T, :], p], axis=2) for t, p in zip(buffers, pads)) if buffers else tuple(pads)


def joined_prefix(segments: list):
    """Lent segments as one (keys, values) prefix: the segment's own views, or (several pieces) one
    copy for the whole batch; None for none."""
    if not segments:
        return None
    if len(segments) == 1:
        return tuple(segments[0].arrays)
    return tuple(mx.concatenate([s.arrays[i] for s in segments], axis=2) for i in range(len(segments[0].arrays)))


def _f32(a):
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def routed_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point; rows over shared prefixes attend here."""
    if isinstance(cache, RowsCache):
        fetched = cache._fetched
        if sinks is not None or fetched is None or keys is not fetched[0] or values is not fetched[1]:
            raise Unroutable("the model attends to keys other than its cache's (or with sinks)")
        return cache.attend(queries, scale)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _model_modules(model) -> list:
    names = {type(m).__module__ for _, m in model.named_modules()}
    return [sys.modules[n] for n in sorted(names) if getattr(sys.modules.get(n), "scaled_dot_product_attention",
                                                              None) is _ORIGINAL]


@contextmanager
def routing(model, attend=None):
    """While in it, `model`'s modules attend through `attend` (default `routed_attention`: calls with
    other caches are mlx-lm's own); afterwards they are as they were. Yields whether any module was
    routed (none inside another routing: a module already routed is left to it)."""
    modules = _model_modules(model)
    for m in modules:
        m.scaled_dot_product_attention = attend or routed_attention
    try:
        yield bool(modules)
    finally:
        for m in modules:
            m.scaled_dot_product_attention = _ORIGINAL
