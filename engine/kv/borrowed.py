"""A borrower's KV cache: the cached prefix lent as immutable segments, then a buffer of its own.

A hit lends the cached prefix as `Segment`s (exact-length views of published
buffers, which nobody writes). Until it appends, a `BorrowedKVCache` holds
nothing of its own: a loan is free. At its first append it copies the prefix
into one buffer of its own with room to grow, and from then on it is mlx-lm's
`KVCache`, operation for operation: the same slice assignments, the same
growth by 256 positions, the same (keys, values) views handed to the model, so
every model attends with its own attention (a fused kernel where MLX has one)
and every token after a hit costs what it costs after a cold prefill. The copy
is paid once per hit (measured in docs/benchmarks.md, issue 28); a borrower
that takes the place of its lender (a rerun: `hand_over`) appends into the
lender's buffer in place and copies nothing.

What a borrower publishes (codecs.py `capture`) still shares the lent
segments: the document under several questions is held once, and each
question's checkpoint adds only its own positions (copied out of the live
buffer, which goes with the generation). Trailing lent segments that are
short are folded into the borrower's own positions instead (`to_merge`), so
a growing chat keeps a few segments of geometrically growing length.

Numerics: positions the borrower computes attend over the same numbers as a
cold run would; only where the prefill chunks start differs (the prefix came
from the cache), so a hit continues within the rounding of a cold run with
another prefill chunk. `BorrowedQuantizedKVCache` is the same over mlx-lm's
`QuantizedKVCache` state ((packed, scales, biases) of keys and of values).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import base as lm_base

STEP = 256  # growth, as mlx-lm's KVCache
MERGE_TOKENS = 256  # trailing segments this short are folded into a publication's own positions


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
    """How many trailing segments a publication with `tail` positions of its own should fold
    into them (copy) rather than share: while the last one is no longer than what is folded so
    far plus MERGE_TOKENS.

    Shared segments then at least double towards the front, so a checkpoint holds a few
    pieces at any length, and each position is copied O(log n) times however long a chat
    grows. One long document stays one segment: every question over it shares it.
    """
    k = 0
    for s in reversed(segments):
        if s.length > tail + MERGE_TOKENS:
            break
        tail += s.length
        k += 1
    return k


class BorrowedKVCache:
    """Like mlx-lm's `KVCache` (its interface, and after the first append its operations),
    over `lent` segments it never writes.

    buffers: this cache's own arrays along the token axis ((keys, values) here, the
    quantized triples of each in `BorrowedQuantizedKVCache`), () until the first append.
    hand_over: a segment whose whole buffers (`parents`) this borrower takes over when it
    takes the lender's place: it appends there in place, without copying.
    keep: positions [0, keep) of those buffers that others view again once this borrower is
    done (a loan in place, cache/in_place.py: `share_back`); never written here.
    """

    step = STEP

    def __init__(self, lent=(), hand_over: Segment | None = None, merge=None, offset: int | None = None,
                 keep: int = 0):
        """merge: how rows of this cache join mlx-lm's batch decoding (given by the codec).
        offset: where a hand-over's borrower starts (default: the whole segment)."""
        self._merge = merge
        self.lent = list(lent)  # shared: never written
        self.buffers: tuple = ()
        self.offset = sum(s.length for s in self.lent)
        self.keep, self._kept = keep, None  # _kept: the buffers the kept positions stay in, once written below
        if hand_over is not None:
            if self.lent:
                raise ValueError("a hand-over is of the whole prefix: one segment")
            n = hand_over.length if offset is None else offset
            if not 0 < n <= hand_over.length or keep > n:
                raise ValueError(f"cannot hand over {n} of {hand_over.length} positions")
            self.buffers, self.offset = tuple(hand_over.parents), n

    # --- what differs between plain and quantized KV ---

    def _encode(self, keys, values) -> tuple:
        """New positions as the buffers store them."""
        return keys, values

    def _sides(self, arrays: tuple) -> tuple:
        """(keys, values) as the model and its attention take them."""
        return arrays

    # --- mlx-lm's cache interface ---

    def update_and_fetch(self, keys, values):
        new = self._encode(keys, values)
        n = keys.shape[2]
        if self.offset < self.keep and self._kept is None:  # below what others view again: write copies
            self._kept, self.buffers = self.buffers, tuple(mx.array(b) for b in self.buffers)
        if not self.buffers or self.offset + n > self.buffers[0].shape[2]:
            self._grow(new, n)
        prev, self.offset = self.offset, self.offset + n
        for buf, a in zip(self.buffers, new):
            buf[..., prev : self.offset, :] = a
        return self._sides(self._views())

    def _grow(self, new: tuple, n: int) -> None:
        """Room for n more positions, as mlx-lm's KVCache grows (whole steps of zeros). The first
        time, the lent positions are copied in: the one copy a hit costs."""
        room = (self.step + n - 1) // self.step * self.step
        pads = [mx.zeros((*a.shape[:2], room, a.shape[3]), a.dtype) for a in new]
        if self.buffers:
            held = [[b[..., : self.offset, :] if self.offset % self.step else b] for b in self.buffers]
        else:
            lent = cut_segments(self.lent, self.offset) if self.offset else ()
            held = [[s.arrays[i] for s in lent] for i in range(len(pads))]
        self.buffers = tuple(mx.concatenate([*h, pad], axis=2) if h else pad for h, pad in zip(held, pads))

    def _views(self) -> tuple:
        if self.offset < self.buffers[0].shape[2]:
            return tuple(b[..., : self.offset, :] for b in self.buffers)
        return self.buffers

    def size(self):
        return self.offset

    @property
    def state(self):
        return self.buffers if self.buffers else tuple(a for s in self.lent for a in s.arrays)

    @property
    def meta_state(self):
        return ""

    @property
    def keys(self):
        """The keys of every position (lazy joined segments before the first append)."""
        return self._whole()[0] if self.offset else None

    @property
    def values(self):
        return self._whole()[1] if self.offset else None

    def _whole(self) -> tuple:
        if self.buffers:
            return self._sides(self._views())
        lent = cut_segments(self.lent, self.offset)
        return self._sides(tuple(p[0] if len(p) == 1 else mx.concatenate(p, axis=2)
                                 for p in zip(*(s.arrays for s in lent))))

    def share_back(self) -> Segment:
        """The kept positions, for those who view them again after a loan in place: one segment over
        the buffers holding them (its parents), which this cache lends itself from now on (what it
        publishes shares it)."""
        whole = self._kept or self.buffers
        seg = Segment(tuple(b[..., : self.keep, :] for b in whole), Buffer(sum(int(b.nbytes) for b in whole)), whole)
        self.lent, self.keep = [seg], 0
        return seg

    def lent_segments(self) -> list[Segment]:
        """The lent segments still covering positions this cache holds (shared, never written)."""
        n = min(self.offset, sum(s.length for s in self.lent))
        return list(cut_segments(self.lent, n)) if n else []

    def own_views(self, start: int) -> tuple:
        """Views of positions [start, offset) of this cache's own buffers (every array), or ()."""
        if not self.buffers or start >= self.offset:
            return ()
        return tuple(a[..., start : self.offset, :] for a in self.buffers)

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """As mlx-lm's KVCache makes its mask (models call it through create_attention_mask)."""
        if window_size is not None or (N > 1 and return_array):
            return lm_base.create_causal_mask(N, self.offset, window_size=window_size)
        return None if N == 1 else "causal"

    def merge(self, caches):
        """Rows joining a batch (engine/generate/batch/run.py): into mlx-lm's batch cache, as its `KVCache` merges
        (one left-padded copy of every row: mlx-lm's batch decoding needs it)."""
        if self._merge is None:
            raise TypeError("this borrowed cache cannot join a batch")
        return self._merge(caches)

    def empty(self):
        return self.offset == 0

    @property
    def nbytes(self):
        """Bytes this cache holds of its own (the lent segments are the lender's)."""
        return sum(int(a.nbytes) for a in self.buffers)


class BorrowedQuantizedKVCache(BorrowedKVCache):
    """The same over mlx-lm's `QuantizedKVCache` state: (packed, scales, biases) of the keys, then
    of the values. `bits` and `group_size` route mlx-lm's attention to its quantized path."""

    def __init__(self, lent=(), *, group_size: int, bits: int, quantized_from: int = 0):
        """quantized_from: the length its lender's run converted at (kv/quantize_start.py), or 0."""
        self.group_size, self.bits, self.quantized_from = group_size, bits, quantized_from
        super().__init__(lent)  # (quantized rows do not batch)

    def _encode(self, keys, values):
        return (*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                *mx.quantize(values, group_size=self.group_size, bits=self.bits))

    def _sides(self, arrays):
        return (tuple(arrays[:3]), tuple(arrays[3:])) if arrays else ()
