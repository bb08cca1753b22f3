"""The immutable checkpoint: the KV state of one exact token prefix.

A checkpoint holds, per layer, the mlx-lm cache class name, evaluated arrays
cut to exactly the tokens they encode (in segments: codecs.py), and the
JSON-able scalars the class needs. Borrowers get fresh cache objects over
views of these arrays (`lend`), so decoding writes into the borrower's own
buffers: MLX never updates a buffer in place while another array still
refers to it, and a plain KV borrower appends to a tail of its own
(kv/borrowed.py), never copying the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

from .borrowed import Buffer, cut_segments
from .codecs import capture_layer, codec
from .layers import LayerState, own


@dataclass(frozen=True)
class HostTensor:
    """A numpy view of one evaluated MLX array, for worker threads.

    `array` may be strided (a slice of a larger buffer); bfloat16 arrives as
    its uint16 bits and `dtype` keeps the logical name. `span`: it holds
    positions [0, len(tokens)) along axis -2, so it is stored in shared
    blocks of token spans (format 2); other state is stored inline.
    """

    name: str
    dtype: str
    shape: tuple
    array: np.ndarray
    span: bool = False

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass(frozen=True)
class Pieces:
    """A span tensor held in pieces along axis -2 (a borrower's shared segments and its own):
    the storage writer cuts blocks from the pieces, never joining them."""

    parts: tuple  # numpy views, in position order

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.parts)


# --- the checkpoint ---------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Checkpoint:
    tokens: tuple
    layers: tuple
    nbytes: int
    min_reusable_offset: int = 0
    attachments: dict = field(default_factory=dict)  # name -> evaluated mx.array

    @classmethod
    def capture(
        cls,
        tokens: Sequence[int],
        caches: Iterable[Any],
        *,
        copy: bool = False,
        min_reusable_offset: int = 0,
        attachments: dict | None = None,
    ) -> "Checkpoint":
        """Publish the exact state of live mlx-lm caches that hold `tokens`.

        copy=False keeps views of the live buffers: only for caches that will
        not be appended to again (the end of a generation); their whole
        buffers are counted, and buffers mostly padding are compacted
        (layers.COMPACT_RATIO). copy=True packs exact-length copies of what
        the caches may still write, so a generation can keep decoding into
        its own buffers (a borrower's shared prefix is never copied).
        """
        caches = list(caches)
        layers = tuple(capture_layer(c, copy) for c in caches)
        min_reusable_offset = max([min_reusable_offset] + [codec(l.kind).min_reusable_offset(l.meta) for l in layers])
        attachments = dict(attachments or {})
        mx.eval([a for l in layers for s in l.all_segments() for a in s.arrays] + list(attachments.values()))
        tokens = tuple(int(t) for t in tokens)
        cp = cls(tokens, layers, _held_bytes(layers, attachments), min_reusable_offset, attachments)
        cp._check_length()
        return cp

    @classmethod
    def of_layers(cls, tokens: Sequence[int], layers: tuple) -> "Checkpoint":
        """A checkpoint of layer states built elsewhere (a batch row's: kv/cascade.py), evaluated."""
        mx.eval([a for l in layers for s in l.all_segments() for a in s.arrays])
        since = max([0] + [codec(l.kind).min_reusable_offset(l.meta) for l in layers])  # a row converted at kv_start
        cp = cls(tuple(int(t) for t in tokens), tuple(layers), _held_bytes(layers, {}), since, {})
        cp._check_length()
        return cp

    def _check_length(self) -> None:
        for layer in self.layers:
            n = layer.meta.get("offset")
            if n is not None and n != len(self.tokens) and layer.slots():
                raise ValueError(
                    f"cache holds {n} positions but the checkpoint key has {len(self.tokens)} tokens"
                )

    # --- queries ---

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the state itself (exact lengths); `nbytes` is what it holds in RAM."""
        return sum(l.kv_bytes for l in self.layers) + sum(int(a.nbytes) for a in self.attachments.values())

    def buffers(self) -> list[Buffer]:
        """The buffers the layers are views of, each once (several checkpoints may share one)."""
        return _distinct(self.layers)

    def segment_uses(self) -> list[tuple]:
        """(buffer, bytes of it this checkpoint uses) per segment: what shared KV amounts to."""
        return [(s.buffer, s.nbytes) for l in self.layers for s in l.all_segments()]

    @property
    def trimmable(self) -> bool:
        return not self.attachments and all(codec(l.kind).trimmable(l.meta) for l in self.layers)

    def can_serve(self, n: int) -> bool:
        """Whether this checkpoint can serve the prefix of length n."""
        if n > len(self.tokens) or n < self.min_reusable_offset or n < 1:
            return False
        return n == len(self.tokens) or self.trimmable

    # --- lending ---

    def lend(self, n: int | None = None) -> list:
        """Fresh mlx-lm cache objects over zero-copy views of the first n tokens."""
        n = len(self.tokens) if n is None else n
        if not self.can_serve(n):
            raise ValueError(f"checkpoint of {len(self.tokens)} tokens cannot serve {n}")
        return [codec(l.kind).lend(l, n) for l in self.layers]

    @property
    def can_hand_over(self) -> bool:
        """Whether `hand_over` applies (plain KV layers, no attachments)."""
        return bool(self.layers) and not self.attachments and all(codec(l.kind).can_hand_over(l) for l in self.layers)

    def hand_over(self, n: int, in_place: bool = True, keep: int = 0) -> list:
        """Caches for a borrower that takes this checkpoint's place, at offset n (n <= len).

        in_place (nothing else holds this checkpoint's buffers, and the caller
        drops it): where a layer's first buffer holds the n positions, the
        borrower appends there in place instead of copying them; never below
        `keep` (positions others view again after a loan in place).
        """
        if not self.can_hand_over or not 0 < n <= len(self.tokens):
            raise ValueError(f"cannot hand over {n} tokens of this checkpoint")
        return [codec(l.kind).hand_over(l, n, in_place, keep) for l in self.layers]

    def prefix(self, n: int) -> "Checkpoint":
        """A checkpoint of the first n tokens sharing this one's memory."""
        if n == len(self.tokens):
            return self
        if not self.can_serve(n):
            raise ValueError(f"checkpoint of {len(self.tokens)} tokens cannot serve {n}")
        layers = tuple(codec(l.kind).cut(l, n) for l in self.layers)
        return Checkpoint(self.tokens[:n], layers, _held_bytes(layers, {}), self.min_reusable_offset, {})

    def sharing(self, donor: "Checkpoint", n: int) -> "Checkpoint | None":
        """This checkpoint with its first n positions held by `donor`'s buffers, and the rest copied
        out of its own (so its own buffers can go): a restore whose first n positions the caller
        knows to be byte for byte the donor's (read from the same SSD blocks). None where a layer
        is not segments along the token axis in both."""
        if self.attachments or len(donor.layers) != len(self.layers) or not 0 < n <= min(len(self), len(donor)):
            return None
        layers = []
        for mine, theirs in zip(self.layers, donor.layers):
            c = codec(mine.kind)
            if not (c.segmented and theirs.kind == mine.kind and c.linear(mine.meta) and c.linear(theirs.meta)):
                return None
            rest = tuple(a[..., n:, :] for a in mine.arrays) if n < len(self) else ()
            layers.append(LayerState(mine.kind, cut_segments(theirs.segments, n) + (own(rest, (), True) if rest else ()),
                                     dict(mine.meta)))
        layers = tuple(layers)
        mx.eval([a for l in layers for s in l.all_segments() for a in s.arrays])
        return Checkpoint(self.tokens, layers, _held_bytes(layers, {}), self.min_reusable_offset, {})

    # --- host views and reconstruction (storage) ---

    def tensor_names(self) -> list[str]:
        names = [f"layers.{i}.{j}" for i, l in enumerate(self.layers) for j in range(len(l.slots()))]
        return names + [f"attachments.{k}" for k in sorted(self.attachments)]

    def arrays(self) -> list:
        """Every tensor whole (a layer in several segments is joined: a copy once evaluated)."""
        return [a for l in self.layers for a in l.arrays] + [
            self.attachments[k] for k in sorted(self.attachments)
        ]

    def host_tensors(self) -> list[HostTensor]:
        """Zero-copy numpy views of every tensor (`Pieces` for one in several segments).
        Call on the MLX owner thread."""
        out = []
        slots = [p for l in self.layers for p in l.slots()] + [[self.attachments[k]] for k in sorted(self.attachments)]
        spans = [f for l in self.layers for f in codec(l.kind).linear_arrays(l)] + [False] * len(self.attachments)
        n = len(self.tokens)
        for name, parts, span in zip(self.tensor_names(), slots, spans):
            a = parts[0]
            dtype = str(a.dtype).removeprefix("mlx.core.")
            views = [p.view(mx.uint16) if p.dtype == mx.bfloat16 else p for p in parts]
            mx.eval(views)
            shape = (*a.shape[:-2], sum(int(p.shape[-2]) for p in parts), a.shape[-1]) if a.ndim >= 2 else tuple(a.shape)
            span = span and a.ndim >= 2 and shape[-2] == n
            host = [np.asarray(v) for v in views]
            out.append(HostTensor(name, dtype, tuple(shape), host[0] if len(host) == 1 else Pieces(tuple(host)), span))
        return out

    def layout(self) -> list[dict]:
        """JSON-able description of the layers (kind, meta, array count)."""
        return [l.to_json() for l in self.layers]

    @classmethod
    def from_tensors(
        cls,
        tokens: Sequence[int],
        layout: list[dict],
        tensors: dict,
        *,
        min_reusable_offset: int = 0,
        parents: dict | None = None,
    ) -> "Checkpoint":
        """Rebuild from `layout()` and a name -> evaluated mx.array mapping; `parents`: the whole
        buffers (with room to grow) some tensors are the first positions of."""
        layers, parents = [], parents or {}
        for i, spec in enumerate(layout):
            names = [f"layers.{i}.{j}" for j in range(int(spec["arrays"]))]
            whole = tuple(parents[n] for n in names) if names and all(n in parents for n in names) else ()
            layers.append(codec(spec["kind"]).rebuilt(tuple(tensors[n] for n in names), dict(spec["meta"]), whole))
        attachments = {
            k.removeprefix("attachments."): v for k, v in tensors.items() if k.startswith("attachments.")
        }
        layers = tuple(layers)
        cp = cls(tuple(int(t) for t in tokens), layers, _held_bytes(layers, attachments), min_reusable_offset, attachments)
        cp._check_length()
        return cp



def _distinct(layers) -> list[Buffer]:
    seen = {}
    for l in layers:
        for s in l.all_segments():
            seen.setdefault(id(s.buffer), s.buffer)
    return list(seen.values())


def _held_bytes(layers, attachments: dict) -> int:
    """What a checkpoint keeps alive: every buffer its layers view (once), and its attachments."""
    return sum(b.nbytes for b in _distinct(layers)) + sum(int(a.nbytes) for a in attachments.values())
