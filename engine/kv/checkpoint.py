"""The immutable checkpoint: the KV state of one exact token prefix.

A checkpoint holds, per layer, the mlx-lm cache class name, evaluated arrays
cut to exactly the tokens they encode, and the JSON-able scalars the class
needs. Borrowers get fresh mlx-lm cache objects over views of these arrays
(`lend`), so decoding writes into the borrower's own buffers: MLX never
updates a buffer in place while another array still refers to it, and an
exact-length view forces the first append to grow into a new buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

from .codecs import LayerState, capture_layer, codec


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
        parent buffers are counted. copy=True packs exact-length copies, so a
        generation can keep decoding into its own buffers.
        """
        caches = list(caches)
        layers = [capture_layer(c) for c in caches]
        if copy:  # mx.array copies (mx.contiguous would keep a contiguous view)
            layers = [LayerState(l.kind, tuple(mx.array(a) for a in l.arrays), l.meta) for l in layers]
        min_reusable_offset = max([min_reusable_offset] + [codec(l.kind).min_reusable_offset(l.meta) for l in layers])
        arrays = [a for l in layers for a in l.arrays]
        attachments = dict(attachments or {})
        mx.eval(arrays + list(attachments.values()))
        if copy:
            nbytes = sum(l.kv_bytes for l in layers)
        else:  # a slice keeps its whole parent alive
            nbytes = sum(int(getattr(c, "nbytes", 0) or 0) for c in caches)
            nbytes = max(nbytes, sum(l.kv_bytes for l in layers))
        nbytes += sum(int(a.nbytes) for a in attachments.values())
        tokens = tuple(int(t) for t in tokens)
        cp = cls(tokens, tuple(layers), nbytes, min_reusable_offset, attachments)
        cp._check_length()
        return cp

    def _check_length(self) -> None:
        for layer in self.layers:
            n = layer.meta.get("offset")
            if n is not None and n != len(self.tokens) and layer.arrays:
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
        """Whether `hand_over` applies: every layer still holds its live buffers."""
        return bool(self.layers) and not self.attachments and all(codec(l.kind).can_hand_over(l) for l in self.layers)

    def hand_over(self, n: int) -> list:
        """Cache objects over the whole live buffers, at offset n (n <= len).

        For a borrower that takes this checkpoint's place: once the caller
        drops the checkpoint, the buffers have one owner and decoding appends
        in place; no copy of the prefix on the first step.
        """
        if not self.can_hand_over or not 0 < n <= len(self.tokens):
            raise ValueError(f"cannot hand over {n} tokens of this checkpoint")
        return [codec(l.kind).hand_over(l, n) for l in self.layers]

    def prefix(self, n: int) -> "Checkpoint":
        """A checkpoint of the first n tokens sharing this one's memory."""
        if n == len(self.tokens):
            return self
        if not self.can_serve(n):
            raise ValueError(f"checkpoint of {len(self.tokens)} tokens cannot serve {n}")
        layers = tuple(capture_layer(c) for c in self.lend(n))
        # views keep this checkpoint's whole buffers alive: count what they hold
        return Checkpoint(self.tokens[:n], layers, self.nbytes, self.min_reusable_offset, {})

    # --- host views and reconstruction (storage) ---

    def tensor_names(self) -> list[str]:
        names = [f"layers.{i}.{j}" for i, l in enumerate(self.layers) for j in range(len(l.arrays))]
        return names + [f"attachments.{k}" for k in sorted(self.attachments)]

    def arrays(self) -> list:
        return [a for l in self.layers for a in l.arrays] + [
            self.attachments[k] for k in sorted(self.attachments)
        ]

    def host_tensors(self) -> list[HostTensor]:
        """Zero-copy numpy views of every tensor. Call on the MLX owner thread."""
        out = []
        spans = [f for l in self.layers for f in codec(l.kind).linear_arrays(l)] + [False] * len(self.attachments)
        n = len(self.tokens)
        for name, a, span in zip(self.tensor_names(), self.arrays(), spans):
            dtype = str(a.dtype).removeprefix("mlx.core.")
            view = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            mx.eval(view)
            span = span and a.ndim >= 2 and a.shape[-2] == n
            out.append(HostTensor(name, dtype, tuple(a.shape), np.asarray(view), span))
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
    ) -> "Checkpoint":
        """Rebuild from `layout()` and a name -> evaluated mx.array mapping."""
        layers = []
        for i, spec in enumerate(layout):
            arrays = tuple(tensors[f"layers.{i}.{j}"] for j in range(int(spec["arrays"])))
            layers.append(codec(spec["kind"]).rebuilt(arrays, dict(spec["meta"])))
        attachments = {
            k.removeprefix("attachments."): v for k, v in tensors.items() if k.startswith("attachments.")
        }
        nbytes = sum(int(a.nbytes) for a in tensors.values())
        cp = cls(tuple(int(t) for t in tokens), tuple(layers), nbytes, min_reusable_offset, attachments)
        cp._check_length()
        return cp

