"""One codec per mlx-lm cache class: the only module that names those classes.

A codec answers every question the cache asks about one layer: how to
capture a live cache object into a `LayerState` (evaluated arrays cut to
the tokens they encode, plus JSON-able scalars), how to lend a fresh cache
object over views of that state, whether the state can be cut back to a
shorter prefix (trimmable), and what its arrays are called. Everything else
(checkpoint, RAM tier, SSD format, inspection) asks the codec by the class
name stored in the layer (`LayerState.kind`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as lm_cache


@dataclass(frozen=True)
class LayerState:
    kind: str  # mlx-lm cache class name: the codec's key
    arrays: tuple  # evaluated mx.arrays
    meta: dict  # JSON-able scalars
    parents: tuple = ()  # KVCache: the whole live buffers the arrays are views of (for hand_over)

    def to_json(self) -> dict:
        return {"kind": self.kind, "meta": dict(self.meta), "arrays": len(self.arrays)}

    @property
    def kv_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)


def _seq(a: mx.array, n: int) -> mx.array:
    return a[..., :n, :]


def _lend_linear(c: Any, layer: LayerState, n: int, per_side: int) -> Any:
    """Point a fresh linear cache at views of the first n positions.

    per_side: arrays per keys and per values (1 plain, 3 quantized).
    """
    if layer.arrays:
        cut = [_seq(a, n) for a in layer.arrays]
        keys, values = cut[:per_side], cut[per_side:]
        c.keys, c.values = (keys[0], values[0]) if per_side == 1 else (tuple(keys), tuple(values))
    c.offset = n if layer.arrays else 0
    return c


class Codec:
    kind = ""
    roles: tuple = ()  # names of the arrays, for inspection
    always_cuttable = False  # any live state can be cut back to any shorter prefix

    def capture(self, c: Any, n: int) -> LayerState:
        raise NotImplementedError

    def lend(self, layer: LayerState, n: int) -> Any:
        raise NotImplementedError

    def trimmable(self, meta: dict) -> bool:
        """Whether a state with these scalars can serve a shorter prefix of itself."""
        return False

    def can_cut(self, c: Any) -> bool:
        """Whether a live cache can be captured shorter than its offset."""
        return False

    def can_hand_over(self, layer: LayerState) -> bool:
        return False

    def hand_over(self, layer: LayerState, n: int) -> Any:
        raise ValueError(f"{self.kind} cannot hand over its buffers")


class PlainKV(Codec):
    """`KVCache`: keys/values grow by slice assignment into a padded buffer."""

    kind, roles = "KVCache", ("keys", "values")
    always_cuttable = True

    def capture(self, c, n):
        if c.keys is None:
            return LayerState(self.kind, (), {"offset": 0})
        return LayerState(self.kind, (_seq(c.keys, n), _seq(c.values, n)), {"offset": n}, (c.keys, c.values))

    def lend(self, layer, n):
        return _lend_linear(lm_cache.KVCache(), layer, n, 1)

    def trimmable(self, meta):
        return True

    def can_cut(self, c):
        return True

    def can_hand_over(self, layer):
        return len(layer.parents) == 2

    def hand_over(self, layer, n):
        # The whole live buffers at offset n: once the donor is dropped, the
        # borrower appends in place (MLX copies on write while a queued SSD
        # write still refers to them).
        c = lm_cache.KVCache()
        c.keys, c.values = layer.parents
        c.offset = n
        return c


class RotatingKV(Codec):
    """`RotatingKVCache`: a sliding-window ring; linear in time until it wraps."""

    kind, roles = "RotatingKVCache", ("keys", "values")

    def capture(self, c, n):
        meta = {"offset": n, "keep": int(c.keep), "max_size": int(c.max_size), "idx": int(c._idx)}
        if c.keys is None:
            return LayerState(self.kind, (), meta)
        if n < c.max_size:  # not wrapped: the buffer is linear in time
            meta["idx"] = n
            return LayerState(self.kind, (_seq(c.keys, n), _seq(c.values, n)), meta)
        return LayerState(self.kind, (c.keys, c.values), meta)

    def lend(self, layer, n):
        m, arrays = layer.meta, layer.arrays
        c = lm_cache.RotatingKVCache(max_size=m["max_size"], keep=m["keep"])
        if arrays:
            if n == m["offset"] and m["offset"] >= m["max_size"]:
                c.keys, c.values, c._idx = arrays[0], arrays[1], m["idx"]
            else:
                c.keys, c.values, c._idx = _seq(arrays[0], n), _seq(arrays[1], n), n
            c.offset = n
        return c

    def trimmable(self, meta):
        return meta.get("offset", 0) < meta.get("max_size", 0)

    def can_cut(self, c):
        return c.offset < c.max_size


class QuantizedKV(Codec):
    """`QuantizedKVCache`: (packed, scales, biases) for keys and for values."""

    kind, roles = "QuantizedKVCache", ("keys", "keys_scales", "keys_biases", "values", "values_scales", "values_biases")
    always_cuttable = True

    def capture(self, c, n):
        meta = {"offset": n, "group_size": int(c.group_size), "bits": int(c.bits)}
        if c.keys is None:
            return LayerState(self.kind, (), meta)
        return LayerState(self.kind, tuple(_seq(a, n) for a in (*c.keys, *c.values)), meta)

    def lend(self, layer, n):
        c = lm_cache.QuantizedKVCache(group_size=layer.meta["group_size"], bits=layer.meta["bits"])
        return _lend_linear(c, layer, n, 3)

    def trimmable(self, meta):
        return True

    def can_cut(self, c):
        return True


class Recurrent(Codec):
    """`ArraysCache` / `MambaCache`: recurrent or convolution state, exact boundaries only."""

    def __init__(self, kind: str):
        self.kind = kind

    def capture(self, c, n):
        present = [i for i, a in enumerate(c.cache) if a is not None]
        return LayerState(self.kind, tuple(c.cache[i] for i in present), {"size": len(c.cache), "present": present})

    def lend(self, layer, n):
        c = getattr(lm_cache, self.kind)(layer.meta["size"])
        for i, a in zip(layer.meta["present"], layer.arrays):
            c.cache[i] = a
        return c


CODECS = {c.kind: c for c in (PlainKV(), RotatingKV(), QuantizedKV(), Recurrent("ArraysCache"), Recurrent("MambaCache"))}


def codec(kind: str) -> Codec:
    try:
        return CODECS[kind]
    except KeyError:
        raise TypeError(f"cache class {kind} is not supported by the prompt cache") from None


def kind_of(c: Any) -> str:
    return type(c).__name__


def capture_layer(c: Any, length: int | None = None) -> LayerState:
    """The state of one live cache; `length` cuts a trimmable cache shorter."""
    co = codec(kind_of(c))
    offset = getattr(c, "offset", None)
    n = int(offset) if length is None and offset is not None else length
    if length is not None and offset is not None and length != offset:
        if not co.can_cut(c):
            raise ValueError(f"{co.kind} at offset {offset} cannot be cut to {length} tokens")
        if length > offset:
            raise ValueError(f"cache holds {offset} tokens, cannot capture {length}")
    return co.capture(c, n)


def layer_trimmable(kind: str, meta: dict) -> bool:
    return codec(kind).trimmable(meta)


def always_cuttable(caches: list) -> bool:
    """Whether every live cache can be cut back to any prefix, whatever happens next.

    Then a generation's final (or interrupted) state also serves its prompt;
    otherwise (a window that may wrap, recurrent state) the prompt boundary
    needs a snapshot of its own.
    """
    return bool(caches) and all(kind_of(c) in CODECS and CODECS[kind_of(c)].always_cuttable for c in caches)


def array_names(kind: str, count: int) -> list[str]:
    roles = CODECS[kind].roles if kind in CODECS else ()
    return [roles[i] if i < len(roles) else f"state{i}" for i in range(count)]


def new_caches(model) -> list:
    """Empty live caches for a model, as mlx-lm makes them."""
    return lm_cache.make_prompt_cache(model)


def kv_scheme(model, dtype: str) -> str:
    """What the model's KV state is made of: cache classes and weight dtype."""
    return "+".join(sorted({kind_of(c) for c in new_caches(model)})) + ":" + dtype
