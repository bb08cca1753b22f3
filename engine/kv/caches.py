"""Questions about a model's list of live caches, answered by each layer's codec (codecs.py).

Whether every layer is known, can always be cut back, can join mlx-lm's batch
decoding; what the KV scheme is called; a fresh list (quantized on request).
"""

from __future__ import annotations

import mlx.core as mx

from .codecs import CODECS, capture_layer, codec, kind_of, make_caches, plain_caches
from .layers import LayerState


def unsupported(caches: list) -> list[str]:
    """Names of cache classes (nested ones included) that no codec knows."""
    out = []
    for c in caches:
        kind = kind_of(c)
        out += [kind] if kind not in CODECS else unsupported(CODECS[kind].inner(c))
    return sorted(set(out))


def always_cuttable(caches: list) -> bool:
    """Whether every live cache can be cut back to any prefix, whatever happens next.

    Then a generation's final (or interrupted) state also serves its prompt;
    otherwise (a window that may wrap, recurrent state) the prompt boundary
    needs a snapshot of its own.
    """
    return bool(caches) and all(kind_of(c) in CODECS and CODECS[kind_of(c)].always_cuttable for c in caches)


def move_blockers(caches: list) -> list[str]:
    """Why the keys of these caches cannot be rotated to other positions (nested ones included): []
    when every layer is plain KV (generate/passages/)."""
    out = []
    for c in caches:
        kind = kind_of(c)
        inner = CODECS[kind].inner(c) if kind in CODECS else []
        out += move_blockers(inner) if inner else [CODECS[kind].unmovable if kind in CODECS else kind]
    return sorted(set(b for b in out if b))


def kv_arrays(c) -> tuple:
    """A plain KV cache's (keys, values) over the positions it holds (None, None when empty)."""
    slots = capture_layer(c).slots()
    if not slots:
        return None, None
    return tuple(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-2) for pieces in slots)


def holding(like, keys, values) -> object:
    """A live cache of `like`'s (plain KV) kind holding these (keys, values): lent, so its first
    append copies them into a buffer of its own."""
    n = int(keys.shape[-2])
    return codec(kind_of(like)).lend(LayerState.whole(kind_of(like), (keys, values), {"offset": n}), n)


def array_names(kind: str, count: int) -> list[str]:
    roles = CODECS[kind].roles if kind in CODECS else ()
    return [roles[i] if i < len(roles) else f"state{i}" for i in range(count)]


def new_caches(model, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """Empty live caches for a model, as mlx-lm makes them; with kv_bits, its
    plain KV layers quantized from the first token (other kinds stay as they are)."""
    caches = make_caches(model)
    if kv_bits is None:
        return caches
    return [codec(kind_of(c)).quantized(c, kv_bits, kv_group_size) if kind_of(c) in CODECS else c for c in caches]


def not_batchable(caches: list) -> list[str]:
    """Cache classes (nested too) mlx-lm's BatchGenerator cannot merge: quantized, chunked, keep > 0."""
    return sorted({b for c in caches for b in (codec(kind_of(c)).batch_blockers(c) if kind_of(c) in CODECS
                                                 else [kind_of(c)])})


def kv_scheme(caches: list, dtype: str, kv_bits: int | None = None, kv_group_size: int = 64, kv_start: int = 0) -> str:
    """What the model's KV state is made of: cache classes, weight dtype, quantization (and from
    which token on: a part of the model's namespace, as the numbers differ)."""
    scheme = "+".join(sorted({kind_of(c) for c in caches})) + ":" + dtype
    if kv_bits is None:
        return scheme
    return f"{scheme}:q{kv_bits}g{kv_group_size}" + (f"@{kv_start}" if kv_start else "")


def mlx_lm_caches(caches: list | None, layers: int) -> list:
    """Another package's fresh caches (mlx-vlm's) as mlx-lm's classes of the same names and settings;
    None: plain KV for each of `layers`. A kind no codec knows stays (the model then runs uncached)."""
    if caches is None:
        return plain_caches(layers)
    return [CODECS[kind_of(c)].empty_like(c) if kind_of(c) in CODECS else c for c in caches]


def hit_summary(caches: list) -> dict:
    """What a hit gives each cache class of a model (kind -> description), nested ones included."""
    out = {}
    for c in caches:
        kind = kind_of(c)
        if kind in CODECS:
            inner = CODECS[kind].inner(c)
            out.update(hit_summary(inner) if inner else {kind: CODECS[kind].hit})
    return out


def shares_prefix(caches: list) -> bool:
    """Whether batch rows of these caches can attend to a shared prefix once (every layer plain KV)."""
    return bool(caches) and all(kind_of(c) in CODECS and CODECS[kind_of(c)].shares_prefix for c in caches)


def lent_segments(c) -> list:
    """The segments a borrowed cache was lent (shared, never written), covering what it holds."""
    return c.lent_segments()


def published_layer(like, lent: list, own: tuple, n: int, meta: dict | None = None):
    """A layer of n positions of `like`'s kind: lent segments, then a batch row's own arrays."""
    return codec(kind_of(like)).published(lent, own, n, meta)


def quantized_like(like, bits: int, group_size: int):
    """An empty cache of `like`'s kind with its KV quantized (`like` itself if it is, or has no such form)."""
    return codec(kind_of(like)).quantized(like, bits, group_size)
