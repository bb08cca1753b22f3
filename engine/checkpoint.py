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
from mlx_lm.models import cache as lm_cache


@dataclass(frozen=True)
class LayerState:
    kind: str  # mlx-lm cache class name
    arrays: tuple  # evaluated mx.arrays
    meta: dict  # JSON-able scalars
    parents: tuple = ()  # KVCache: the whole live buffers the arrays are views of (for hand_over)

    def to_json(self) -> dict:
        return {"kind": self.kind, "meta": dict(self.meta), "arrays": len(self.arrays)}


@dataclass(frozen=True)
class HostTensor:
    """A numpy view of one evaluated MLX array, for worker threads.

    `array` may be strided (a slice of a larger buffer); bfloat16 arrives as
    its uint16 bits and `dtype` keeps the logical name.
    """

    name: str
    dtype: str
    shape: tuple
    array: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


# --- per-class codecs -------------------------------------------------------


def _seq(a: mx.array, n: int) -> mx.array:
    return a[..., :n, :]


def _capture_layer(c: Any, length: int | None = None) -> LayerState:
    """The state of one live cache; `length` cuts a trimmable cache shorter."""
    kind = type(c).__name__
    if length is not None and length != getattr(c, "offset", length):
        if not (kind in ("KVCache", "QuantizedKVCache") or (kind == "RotatingKVCache" and c.offset < c.max_size)):
            raise ValueError(f"{kind} at offset {c.offset} cannot be cut to {length} tokens")
        if length > c.offset:
            raise ValueError(f"cache holds {c.offset} tokens, cannot capture {length}")
    if kind == "KVCache":
        n = int(c.offset) if length is None else length
        if c.keys is None:
            return LayerState(kind, (), {"offset": 0})
        return LayerState(kind, (_seq(c.keys, n), _seq(c.values, n)), {"offset": n}, (c.keys, c.values))
    if kind == "RotatingKVCache":
        n, idx = (int(c.offset) if length is None else length), int(c._idx)
        meta = {"offset": n, "keep": int(c.keep), "max_size": int(c.max_size), "idx": idx}
        if c.keys is None:
            return LayerState(kind, (), meta)
        if n < c.max_size:  # not wrapped: the buffer is linear in time
            meta["idx"] = n
            return LayerState(kind, (_seq(c.keys, n), _seq(c.values, n)), meta)
        return LayerState(kind, (c.keys, c.values), meta)
    if kind == "QuantizedKVCache":
        n = int(c.offset) if length is None else length
        meta = {"offset": n, "group_size": int(c.group_size), "bits": int(c.bits)}
        if c.keys is None:
            return LayerState(kind, (), meta)
        arrays = tuple(_seq(a, n) for a in (*c.keys, *c.values))
        return LayerState(kind, arrays, meta)
    if kind in ("ArraysCache", "MambaCache"):
        present = [i for i, a in enumerate(c.cache) if a is not None]
        meta = {"size": len(c.cache), "present": present}
        return LayerState(kind, tuple(c.cache[i] for i in present), meta)
    raise TypeError(f"cache class {kind} is not supported by the prompt cache")


def _layer_trimmable(layer: LayerState) -> bool:
    if layer.kind in ("KVCache", "QuantizedKVCache"):
        return True
    if layer.kind == "RotatingKVCache":
        return layer.meta["offset"] < layer.meta["max_size"]
    return False


def _layer_length(layer: LayerState) -> int | None:
    return layer.meta.get("offset")


def _lend_layer(layer: LayerState, n: int) -> Any:
    kind, m, arrays = layer.kind, layer.meta, layer.arrays
    if kind == "KVCache":
        c = lm_cache.KVCache()
        if arrays:
            c.keys, c.values = _seq(arrays[0], n), _seq(arrays[1], n)
        c.offset = n if arrays else 0
        return c
    if kind == "RotatingKVCache":
        c = lm_cache.RotatingKVCache(max_size=m["max_size"], keep=m["keep"])
        if arrays:
            if n == m["offset"] and m["offset"] >= m["max_size"]:
                c.keys, c.values, c._idx = arrays[0], arrays[1], m["idx"]
            else:
                c.keys, c.values, c._idx = _seq(arrays[0], n), _seq(arrays[1], n), n
            c.offset = n
        return c
    if kind == "QuantizedKVCache":
        c = lm_cache.QuantizedKVCache(group_size=m["group_size"], bits=m["bits"])
        if arrays:
            cut = [_seq(a, n) for a in arrays]
            c.keys, c.values = tuple(cut[:3]), tuple(cut[3:])
        c.offset = n if arrays else 0
        return c
    if kind in ("ArraysCache", "MambaCache"):
        cls = getattr(lm_cache, kind)
        c = cls(m["size"])
        for i, a in zip(m["present"], arrays):
            c.cache[i] = a
        return c
    raise TypeError(f"cache class {kind} is not supported by the prompt cache")


def _layer_nbytes_exact(layer: LayerState) -> int:
    return sum(int(a.nbytes) for a in layer.arrays)


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
        length: int | None = None,
        min_reusable_offset: int = 0,
        attachments: dict | None = None,
    ) -> "Checkpoint":
        """Publish the state of live mlx-lm caches for `tokens`.

        copy=False keeps views of the live buffers: only for caches that will
        not be appended to again (the end of a generation); their whole
        parent buffers are counted. copy=True packs exact-length copies, so a
        generation can keep decoding into its buffers at full speed.
        `length` captures only the first `length` positions (for a decode
        that is already one step past the boundary being published).
        """
        caches = list(caches)
        layers = [_capture_layer(c, length) for c in caches]
        if copy:
            layers = [
                LayerState(l.kind, tuple(mx.contiguous(a) for a in l.arrays), l.meta)
                for l in layers
            ]
        arrays = [a for l in layers for a in l.arrays]
        attachments = dict(attachments or {})
        mx.eval(arrays + list(attachments.values()))
        if copy:
            nbytes = sum(_layer_nbytes_exact(l) for l in layers)
        else:  # a slice keeps its whole parent alive
            nbytes = sum(int(getattr(c, "nbytes", 0) or 0) for c in caches)
            nbytes = max(nbytes, sum(_layer_nbytes_exact(l) for l in layers))
        nbytes += sum(int(a.nbytes) for a in attachments.values())
        tokens = tuple(int(t) for t in tokens)
        cp = cls(tokens, tuple(layers), nbytes, min_reusable_offset, attachments)
        cp._check_length()
        return cp

    def _check_length(self) -> None:
        for layer in self.layers:
            n = _layer_length(layer)
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
        return sum(_layer_nbytes_exact(l) for l in self.layers) + sum(int(a.nbytes) for a in self.attachments.values())

    @property
    def trimmable(self) -> bool:
        return not self.attachments and all(_layer_trimmable(l) for l in self.layers)

    def can_serve(self, n: int) -> bool:
        """Whether this checkpoint can serve the prefix of length n."""
        if n > len(self.tokens) or n < self.min_reusable_offset or n < 1:
            return False
        return n == len(self.tokens) or self.trimmable

    def layer_kinds(self) -> list[str]:
        return [l.kind for l in self.layers]

    # --- lending ---

    def lend(self, n: int | None = None) -> list:
        """Fresh mlx-lm cache objects over zero-copy views of the first n tokens."""
        n = len(self.tokens) if n is None else n
        if not self.can_serve(n):
            raise ValueError(f"checkpoint of {len(self.tokens)} tokens cannot serve {n}")
        return [_lend_layer(l, n) for l in self.layers]

    @property
    def can_hand_over(self) -> bool:
        """Whether `hand_over` applies: plain KV layers still holding their live buffers."""
        return bool(self.layers) and not self.attachments and all(
            l.kind == "KVCache" and len(l.parents) == 2 for l in self.layers
        )

    def hand_over(self, n: int) -> list:
        """KVCache objects over the whole live buffers, at offset n (n <= len).

        For a borrower that takes this checkpoint's place: once the caller
        drops the checkpoint, the buffers have one owner and decoding appends
        in place; no copy of the prefix on the first step. MLX copies on
        write while anyone else (a queued SSD write) still refers to them.
        """
        if not self.can_hand_over or not 0 < n <= len(self.tokens):
            raise ValueError(f"cannot hand over {n} tokens of this checkpoint")
        caches = []
        for layer in self.layers:
            c = lm_cache.KVCache()
            c.keys, c.values = layer.parents
            c.offset = n
            caches.append(c)
        return caches

    def prefix(self, n: int) -> "Checkpoint":
        """A checkpoint of the first n tokens sharing this one's memory."""
        if n == len(self.tokens):
            return self
        if not self.can_serve(n):
            raise ValueError(f"checkpoint of {len(self.tokens)} tokens cannot serve {n}")
        layers = tuple(_capture_layer(c) for c in self.lend(n))
        exact = sum(_layer_nbytes_exact(l) for l in layers)
        return Checkpoint(self.tokens[:n], layers, exact, self.min_reusable_offset, {})

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
        for name, a in zip(self.tensor_names(), self.arrays()):
            dtype = str(a.dtype).removeprefix("mlx.core.")
            view = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            mx.eval(view)
            out.append(HostTensor(name, dtype, tuple(a.shape), np.asarray(view)))
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
            layers.append(LayerState(spec["kind"], arrays, dict(spec["meta"])))
        attachments = {
            k.removeprefix("attachments."): v for k, v in tensors.items() if k.startswith("attachments.")
        }
        nbytes = sum(int(a.nbytes) for a in tensors.values())
        cp = cls(tuple(int(t) for t in tokens), tuple(layers), nbytes, min_reusable_offset, attachments)
        cp._check_length()
        return cp


def mlx_dtype(name: str):
    """The mx dtype for a logical dtype name as stored in files."""
    return getattr(mx, name)
