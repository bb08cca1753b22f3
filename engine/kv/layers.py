"""A layer's captured state (`LayerState`: segments of evaluated arrays along the token axis, and
JSON-able scalars), and how a live cache's own arrays are published as a segment (views, or exact
copies where the buffers are mostly growth padding). The codecs (codecs.py) build them."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .borrowed import STEP, Buffer, Segment

# A published buffer may exceed the KV it holds by this much; beyond it (mlx-lm
# grows caches by 256 positions: 5x the KV of a 48-token prompt) it is copied
# to its exact length when captured.
COMPACT_RATIO = 1.25


@dataclass(frozen=True)
class LayerState:
    kind: str  # mlx-lm cache class name: the codec's key
    segments: tuple  # Segments along the token axis (evaluated arrays); () when empty
    meta: dict  # JSON-able scalars
    parts: tuple = ()  # CacheList: the inner layers (no segments of its own)

    @classmethod
    def whole(cls, kind: str, arrays: tuple, meta: dict, parents: tuple = ()) -> "LayerState":
        """A layer over arrays nothing else holds (read back from storage): whole, or the first
        positions of `parents` (buffers with room to grow: growth_room)."""
        arrays, parents = tuple(arrays), tuple(parents) or tuple(arrays)
        return cls(kind, (Segment(arrays, Buffer(sum(int(p.nbytes) for p in parents)), parents),) if arrays else (),
                   meta)

    def slots(self) -> list[list]:
        """Per array: its pieces along the token axis, in order."""
        if self.parts:
            return [slot for p in self.parts for slot in p.slots()]
        if not self.segments:
            return []
        return [[s.arrays[i] for s in self.segments] for i in range(len(self.segments[0].arrays))]

    @property
    def arrays(self) -> tuple:
        """The whole arrays (several segments: joined lazily, a copy only if evaluated)."""
        return tuple(p[0] if len(p) == 1 else mx.concatenate(p, axis=-2) for p in self.slots())

    def all_segments(self) -> list:
        return [s for p in self.parts for s in p.all_segments()] if self.parts else list(self.segments)

    def to_json(self) -> dict:
        return {"kind": self.kind, "meta": dict(self.meta), "arrays": len(self.slots())}

    @property
    def kv_bytes(self) -> int:
        return sum(s.nbytes for s in self.all_segments())


def growth_room(n: int) -> int:
    """Positions of room a restored buffer of n positions gets, so that the borrower taking it over
    appends in place (codecs.PlainKV.hand_over): up to mlx-lm's next growth step, as the live cache
    that made it had, unless that is more than COMPACT_RATIO allows."""
    room = STEP - n % STEP
    return room if n + room <= COMPACT_RATIO * n else 0


def seq(a: mx.array, n: int) -> mx.array:
    return a[..., :n, :]


def fresh(a: mx.array) -> mx.array:
    """A new array object over the same memory."""
    return a[...]


def own(arrays: tuple, parents: tuple, copy: bool) -> tuple:
    """The segment a live cache's own arrays publish: views of its buffers `parents`,
    or exact copies when asked for (the cache goes on decoding) or when the buffers
    hold much more than the arrays (growth padding)."""
    exact = sum(int(a.nbytes) for a in arrays)
    whole = sum(int(p.nbytes) for p in parents) or exact
    if copy or whole > COMPACT_RATIO * exact:
        arrays = tuple(mx.array(a) for a in arrays)  # mx.array copies (mx.contiguous may keep a view)
        return (Segment(arrays, Buffer(exact), arrays),)
    return (Segment(arrays, Buffer(whole), parents),)
