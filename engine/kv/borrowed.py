"""A borrower's KV cache: shared, immutable prefix segments plus a tail of its own.

A hit lends the cached prefix as `Segment`s (exact-length views of published
buffers). `BorrowedKVCache` appends new tokens only to its own tail, so the
first decode step after a hit never copies the prefix (mlx-lm's `KVCache`
grows by concatenation: a hit over an 8k-token document would copy all of it),
and any number of borrowers share one prefix for free.

Attention runs over the segments and the tail without joining them: the
scores of every piece are concatenated (a row of numbers per query, not the
keys), one softmax, and the pieces' weighted values are summed. This is MLX's
own attention fallback (the CPU path of `mx.fast.scaled_dot_product_attention`)
split by key range: the scores and the softmax are the same numbers; only the
final sum is added in a different order (float32 rounding, ~1e-9 here). A
cache with no prefix attends with `mx.fast.scaled_dot_product_attention`
itself, bit for bit a plain `KVCache`.

Quantized KV (`BorrowedQuantizedKVCache`) splits mlx-lm's quantized
attention the same way. mlx-lm models call
`mlx_lm.models.base.scaled_dot_product_attention(q, k, v, ...)` with the
arrays `update_and_fetch` returned; `route()` (called by the engine for the
models it loads, undone when it closes) wraps that function so that, given exactly the (lazy, never evaluated) arrays a borrowed
cache returned, it attends piecewise. A model that attends some other way
gets those lazy arrays: the whole keys, correct, and the cache collapses into
one buffer at its next update (one copy, as before).
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import base as lm_base

STEP = 256  # tail growth, as mlx-lm's KVCache
MERGE_TOKENS = 256  # trailing segments this short are copied into a new tail rather than kept apart


@dataclass(frozen=True, eq=False)
class Buffer:
    """One allocation that arrays are views of: RAM accounting counts each once."""

    nbytes: int


@dataclass(frozen=True, eq=False)
class Segment:
    """Exact-length views of token positions along axis -2 (keys, values, ...) of one buffer.

    parents: the whole buffers the views cut, when they have room to grow
    into (a borrower that takes the entry's place appends there in place).
    """

    arrays: tuple
    buffer: Buffer
    parents: tuple = ()

    @property
    def length(self) -> int:
        return int(self.arrays[0].shape[-2]) if self.arrays else 0

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    @property
    def room(self) -> int:
        """Positions the whole buffers have past this segment (0 without them)."""
        return int(self.parents[0].shape[-2]) - self.length if self.parents else 0

    def cut(self, n: int) -> "Segment":
        """The first n positions. A cut never hands its buffers over: positions past it are
        someone else's."""
        if n == self.length:
            return self
        return Segment(tuple(a[..., :n, :] for a in self.arrays), self.buffer)


def cut_segments(segments, n: int) -> tuple:
    """The segments covering the first n positions (the last one cut)."""
    out, left = [], n
    for s in segments:
        if left <= 0:
            break
        out.append(s.cut(min(left, s.length)))
        left -= s.length
    if left > 0:
        raise ValueError(f"segments hold fewer than {n} positions")
    return tuple(out)


def to_merge(segments, tail: int = 0) -> int:
    """How many trailing segments a tail of `tail` positions should take in (copy)
    rather than keep apart: while the last one is no longer than what is taken so
    far plus MERGE_TOKENS.

    Kept segments then at least double towards the front, so attention runs
    over a few pieces at any length, and each position is copied O(log n)
    times however long a chat or a generation grows (mlx-lm's own growth
    copies everything every 256 positions). One long document stays one
    segment: a hit on it copies nothing.
    """
    k = 0
    for s in reversed(segments):
        if s.length > tail + MERGE_TOKENS:
            break
        tail += s.length
        k += 1
    return k


_FETCHED: "weakref.WeakValueDictionary[int, BorrowedKVCache]" = weakref.WeakValueDictionary()


class BorrowedKVCache:
    """Like mlx-lm's `KVCache`, over `prefix` segments it never writes.

    The tail is a tuple of arrays along the token axis: (keys, values) here,
    the quantized triples of each in `BorrowedQuantizedKVCache`. hand_over:
    a segment whose whole buffers (`parents`) this borrower takes over when
    it takes the lender's place: it appends in place after the segment.
    """

    step = STEP

    def __init__(self, prefix=(), hand_over: Segment | None = None, merge=None):
        """merge: how rows of this cache join mlx-lm's batch decoding (given by the codec)."""
        self._merge = merge
        self.prefix = list(prefix)  # shared: never written
        self._seed: list = []  # trailing segments the first growth copies into the tail
        self.tail: tuple = ()  # this cache's own buffers
        self.tail_len = 0
        if hand_over is not None:
            self.tail, self.tail_len = tuple(hand_over.parents), hand_over.length
        else:
            self._take_in(self.prefix)
        self.offset = sum(s.length for s in self.prefix + self._seed) + self.tail_len
        self._fetched = None  # the lazy (keys, values) update_and_fetch last returned
        self._attended = False

    # --- what differs between plain and quantized KV ---

    def _encode(self, keys, values) -> tuple:
        """New positions as the tail stores them."""
        return keys, values

    def _sides(self, arrays: tuple) -> tuple:
        """(keys, values) as the model and the attention take them."""
        return arrays

    def attend(self, queries, scale: float, mask, sinks=None):
        """Attention of `queries` over prefix and tail (see the module docstring)."""
        self._attended = True
        return piecewise_attention(queries, self._pieces(), scale, mask, sinks)

    # --- mlx-lm's cache interface ---

    def update_and_fetch(self, keys, values):
        last, self._fetched = self._fetched, None  # never keep a view of the tail across an update
        if last is not None:
            _FETCHED.pop(id(last[0]), None)
            if self.prefix and not self._attended:  # the model attends some other way: one buffer
                self._collapse()
        self._attended = False
        new = self._encode(keys, values)
        n = keys.shape[2]
        if not self.tail or self.tail_len + n > self.tail[0].shape[2]:
            self._grow(new, n)
        t = self.tail_len
        for buf, a in zip(self.tail, new):
            buf[..., t : t + n, :] = a
        self.tail_len += n
        self.offset += n
        own = self.own_views()
        if not self.prefix:
            return self._sides(own)
        fetched = self._sides(tuple(mx.concatenate([s.arrays[i] for s in self.prefix] + [a], axis=2)
                                    for i, a in enumerate(own)))
        self._fetched = fetched
        _FETCHED[id(fetched[0])] = self
        return fetched

    def _grow(self, new: tuple, n: int) -> None:
        """A tail with room for n more. A full tail of MERGE_TOKENS or more is kept apart
        as a segment of its own (it is never written again); a shorter one is copied
        into the new tail with the segments `to_merge` takes in."""
        tail = Segment(self.own_views(), Buffer(sum(int(a.nbytes) for a in self.tail)), self.tail) \
            if self.tail_len else None
        if tail is not None and not self._seed:
            if to_merge(self.prefix, self.tail_len) == 0 and self.tail_len >= MERGE_TOKENS:
                self.prefix.append(tail)
                tail = None
            else:
                self._take_in(self.prefix, self.tail_len)
        seed = [s.arrays for s in self._seed] + ([tail.arrays] if tail is not None else [])
        room = (n + self.step - 1) // self.step * self.step
        pads = [mx.zeros((*a.shape[:2], room, a.shape[3]), a.dtype) for a in new]
        self.tail = tuple(mx.concatenate([part[i] for part in seed] + [pad], axis=2) if seed else pad
                          for i, pad in enumerate(pads))
        self.tail_len = sum(int(part[0].shape[2]) for part in seed)
        self._seed = []

    def _take_in(self, segments, tail: int = 0) -> None:
        """Keep `segments` apart as the prefix but for the trailing ones `to_merge` gives
        the next tail (with `tail` positions of its own)."""
        k = to_merge(segments, tail)
        self.prefix, self._seed = list(segments[: len(segments) - k]), list(segments[len(segments) - k :])

    def _collapse(self) -> None:
        """Everything into a tail of this cache's own at the next growth: a model that
        bypasses the piecewise attention would otherwise join the pieces at every step."""
        self._seed = self.prefix + self._seed + [Segment(self.own_views(), Buffer(0))]
        self.prefix, self.tail, self.tail_len = [], (), 0

    def _pieces(self) -> list:
        """Per piece of positions, (keys, values) as the attention takes them."""
        return [self._sides(s.arrays) for s in self.prefix + self._seed] + [self._sides(self.own_views())]

    def size(self):
        return self.offset

    @property
    def state(self):
        return self.tail

    @property
    def keys(self):
        """The whole keys (lazy; a copy only if evaluated): for code that reads them."""
        return self._whole()[0] if self.offset else None

    @property
    def values(self):
        return self._whole()[1] if self.offset else None

    def _whole(self) -> tuple:
        parts = [s.arrays for s in self.prefix + self._seed] + ([self.own_views()] if self.tail_len else [])
        if not parts:
            return ()
        return self._sides(tuple(p[0] if len(p) == 1 else mx.concatenate(p, axis=2) for p in zip(*parts)))

    def shared_segments(self) -> list[Segment]:
        """The segments this cache reads but never writes."""
        return self.prefix + self._seed

    def own_views(self) -> tuple:
        """Views of this cache's own positions (every array of the tail), or ()."""
        return tuple(a[..., : self.tail_len, :] for a in self.tail) if self.tail_len else ()

    def own_buffers(self) -> tuple:
        return self.tail

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        keep, fixed = self.offset - n, self.offset - self.tail_len  # fixed: prefix and seed positions
        if keep <= fixed:  # into the segments: the tail goes
            self._take_in(cut_segments(self.prefix + self._seed, keep))
            self.tail, self.tail_len = (), 0
        else:
            self.tail_len = keep - fixed
        self.offset = keep
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """As mlx-lm's KVCache makes its mask (models call it through create_attention_mask)."""
        if window_size is not None or (N > 1 and return_array):
            return lm_base.create_causal_mask(N, self.offset, window_size=window_size)
        return None if N == 1 else "causal"

    def merge(self, caches):
        """Rows joining a batch (engine/batch.py): into mlx-lm's batch cache, as its `KVCache` merges
        (one left-padded copy of every row: mlx-lm's batch decoding needs it)."""
        if self._merge is None:
            raise TypeError("this borrowed cache cannot join a batch")
        return self._merge(caches)

    @property
    def meta_state(self):
        return ""

    def empty(self):
        return self.offset == 0

    @property
    def nbytes(self):
        """Bytes this cache holds of its own (the prefix is the lender's)."""
        return sum(s.nbytes for s in self._seed) + sum(int(a.nbytes) for a in self.tail)


class BorrowedQuantizedKVCache(BorrowedKVCache):
    """The same over mlx-lm's `QuantizedKVCache` state: (packed, scales, biases) of the
    keys, then of the values. `bits` and `group_size` also route mlx-lm's own attention
    to its quantized path, should a model bypass the piecewise one."""

    def __init__(self, prefix=(), *, group_size: int, bits: int):
        self.group_size, self.bits = group_size, bits
        super().__init__(prefix)  # (quantized rows do not batch)

    def _encode(self, keys, values):
        return (*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                *mx.quantize(values, group_size=self.group_size, bits=self.bits))

    def _sides(self, arrays):
        return (tuple(arrays[:3]), tuple(arrays[3:])) if arrays else ()

    def attend(self, queries, scale, mask, sinks=None):
        if sinks is not None:
            raise ValueError("Quantized SDPA does not support attention sinks.")  # as mlx-lm's
        self._attended = True
        return piecewise_quantized_attention(queries, self._pieces(), scale, mask, self.group_size, self.bits)


def piecewise_attention(queries, pieces, scale: float, mask, sinks=None):
    """MLX's attention fallback over keys/values split by position into `pieces`."""
    dtype = queries.dtype
    n_q, n_kv = queries.shape[1], pieces[0][0].shape[1]
    rep = n_q // n_kv
    B, _, L, D = queries.shape
    q = queries * mx.array(scale, dtype)
    if rep > 1:
        q = q.reshape(B, n_kv, rep, L, D)
        pieces = [(mx.expand_dims(k, 2), mx.expand_dims(v, 2)) for k, v in pieces]
    scores = mx.concatenate([q @ mx.swapaxes(k, -1, -2) for k, _ in pieces], axis=-1)
    total = scores.shape[-1]
    if isinstance(mask, str):
        mask = mx.arange(total - L, total)[:, None] >= mx.arange(total)[None]
    if mask is not None:
        mask = mx.broadcast_to(mask, (B, n_q, L, total))
        if rep > 1:
            mask = mask.reshape(B, n_kv, rep, L, total)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(dtype)
    if sinks is not None:
        s = mx.expand_dims(sinks.astype(dtype), (0, 2, 3))
        if rep > 1:
            s = s.reshape(1, n_kv, rep, 1, 1)
        scores = mx.concatenate([mx.broadcast_to(s, scores.shape[:-1] + (1,)), scores], axis=-1)
    weights = mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        weights = weights[..., 1:]
    out, start = None, 0
    for _, v in pieces:
        n = v.shape[-2]
        part = weights[..., start : start + n] @ v
        out = part if out is None else out + part
        start += n
    return out.reshape(B, n_q, L, -1) if rep > 1 else out


def piecewise_quantized_attention(queries, pieces, scale: float, mask, group_size: int, bits: int):
    """mlx-lm's quantized attention over (packed, scales, biases) keys/values split into `pieces`."""
    B, n_q, L, D = queries.shape
    n_kv = pieces[0][0][0].shape[-3]
    rep = n_q // n_kv
    q = queries * scale
    if rep > 1:
        q = q.reshape(B, n_kv, rep, L, D)
        pieces = [tuple(tuple(mx.expand_dims(x, -3) for x in side) for side in piece) for piece in pieces]
    scores = mx.concatenate([mx.quantized_matmul(q, *k, transpose=True, group_size=group_size, bits=bits)
                             for k, _ in pieces], axis=-1)
    if mask is not None:
        if isinstance(mask, str):
            total = scores.shape[-1]
            mask = mx.arange(total - L, total)[:, None] >= mx.arange(total)[None]
        if rep > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    out, start = None, 0
    for _, v in pieces:
        n = v[0].shape[-2]
        part = mx.quantized_matmul(weights[..., start : start + n], *v, transpose=False, group_size=group_size,
                                   bits=bits)
        out = part if out is None else out + part
        start += n
    return out.reshape(B, n_q, L, -1) if rep > 1 else out


_ORIGINAL = lm_base.scaled_dot_product_attention


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention entry point, piecewise for the arrays a borrowed cache returned."""
    owner = _FETCHED.get(id(keys))
    if owner is not None and owner._fetched is not None and owner._fetched[0] is keys and owner._fetched[1] is values:
        return owner.attend(queries, scale, mask, sinks)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


_routed = 0  # engines that asked for the routing (route / unroute)


def _swap(old, new) -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models") and getattr(module, "scaled_dot_product_attention", None) is old:
            module.scaled_dot_product_attention = new


def route() -> None:
    """Route mlx-lm's attention through `scaled_dot_product_attention`: its base module (models
    imported later bind it from there) and every model module imported so far. The engine calls
    this for the models it loads, and `unroute` when it closes; the last close undoes it."""
    global _routed
    _routed += 1
    _swap(_ORIGINAL, scaled_dot_product_attention)


def unroute() -> None:
    global _routed
    _routed = max(0, _routed - 1)
    if not _routed:
        _swap(scaled_dot_product_attention, _ORIGINAL)


@contextmanager
def routed():
    """`with routed():` borrowed caches attend piecewise (tests, benchmarks without an engine)."""
    route()
    try:
        yield
    finally:
        unroute()
