"""KV bound to its tokens: recompute the first layer's keys and values of a prefix and compare.

A remote record says "block i holds the KV of these tokens"; its signature
says who said so, not that it is true. The first layer's keys and values
depend only on each token and its position (embedding, norm, projection,
rotary position), not on any other token, so they can be recomputed for
every restored position at a small cost (one embedding lookup and the
first layer's projections: no attention, no other layer) and compared with
what was restored. A block taken from another prompt, or from another
position, or values made up, differ there: the prefix is a miss.

What this does not catch: KV whose first layer is right and whose later
layers are wrong (a writer who computed layer 0 honestly and forged the
rest); that needs recomputing the prefix, which is what a hit avoids.

Cost: the whole prefix in one pass is ~1/20 of a prefill's work but still
~200 ms at 8k tokens on two CPU cores (the query projection is computed and
thrown away). So a lookup first checks a sample: SAMPLE consecutive
positions at a random place (the reader's choice, unknown to a writer) in
every 32-token span, all spans as rows of one batch with their own rotary
offsets (~2% of the positions). A block that is another prompt's or another
position's fails at any position. Only if the sample does not match (or the
model's rotary code does not take per-row offsets) is every position
recomputed, and that verdict stands; a model whose sample never works is
checked whole from then on.

The sample depends only on the tokens, so a lookup computes it ahead
(`ahead`, evaluated with mx.async_eval while the blocks are read) and
compares it once they are there.

How: the model's own forward pass runs with a first-layer cache that keeps
what it is given and stops the pass there (`Stop`), so the model's own
embedding, scaling, norms and rotary code make the reference. It applies
where layer 0 is plain KV (codecs.PlainKV) in the checkpoint and in the model;
anything else (a sliding first layer, quantized KV, a model whose forward
pass does not go through its caches this way) is "unchecked" (None), and
says so in the counters. Owner thread (MLX).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from .codecs import PlainKV, UnsupportedCache, codec, kind_of

CHUNK = 1024  # positions per recomputation pass (bounds the embedding and projection buffers)
SPAN = 32  # a sample per span of this many positions (the remote tier's block)
SAMPLE = 2  # consecutive positions per span
_whole_only: dict = {}  # id() -> weakref of models whose forward pass does not take per-row offsets
TOLERANCE = {mx.float32: (1e-3, 1e-4), mx.float16: (2e-2, 2e-3), mx.bfloat16: (5e-2, 1e-2)}  # (rtol, atol)


class Stop(Exception):
    pass


class Capture:
    """A layer's cache that keeps the keys and values it is given, then stops the forward pass (what the
    model asks of a plain cache before that: its offset, a mask); here at the first layer, in
    generate/passages/ at the one whose keys it measures."""

    def __init__(self, offset: int):
        self.offset = offset
        self.keys = self.got = None

    def make_mask(self, n: int, *args, **kwargs):
        return "causal" if n > 1 else None

    def update_and_fetch(self, keys, values):
        self.got = (keys, values)
        raise Stop


def _plain(kind: str) -> bool:
    try:
        return isinstance(codec(kind), PlainKV)
    except UnsupportedCache:
        return False


class Ahead:
    """The sample of a check computed before the KV it checks is there: of which model and tokens,
    where (`pos`, per row of the batch) and the first-layer keys and values there (evaluating in
    the background)."""

    def __init__(self, model, tokens: Sequence[int], pos: np.ndarray, got: tuple | None, caches=None):
        self.model_id, self.n, self.pos, self.got = id(model), len(tokens), pos, got
        self.caches = caches  # the model's fresh caches it was computed with (reused by the check)
        self.sampled_tokens = _tokens_at(tokens, pos)

    def is_of(self, model, tokens: Sequence[int]) -> bool:
        """Is this the sample of `tokens`: the same model and length, and the same tokens at the sampled
        positions (the reference there depends on nothing else; 30 us at 8k, not 0.4 ms for all of them)."""
        return (self.model_id == id(model) and len(tokens) == self.n
                and np.array_equal(_tokens_at(tokens, self.pos), self.sampled_tokens))


def _tokens_at(tokens: Sequence[int], pos: np.ndarray) -> np.ndarray:
    flat = pos.reshape(-1)
    at = tokens[flat] if isinstance(tokens, np.ndarray) else [tokens[i] for i in flat.tolist()]
    return np.asarray(at, dtype=np.int64)


def ahead(m, tokens: Sequence[int]) -> Ahead | None:
    """The sampled reference for a check of `tokens` (loaded model `m`), started now with
    mx.async_eval; None where the check would not sample (not checkable, short, whole only)."""
    if m is None or m.vision is not None or _is_whole_only(m.model) or len(tokens) < 2 * SPAN:
        return None
    caches = m.new_caches()
    if not caches or not _plain(kind_of(caches[0])):
        return None
    pos = _sample_positions(len(tokens))
    got = _reference(m.model, caches, tokens, pos)
    if got is None:
        return None
    mx.async_eval(*got)
    return Ahead(m.model, tokens, pos, got, caches)  # (only their first is asked anything: the pass stops there)


def bound_to_tokens(m, cp, early: Ahead | None = None) -> bool | None:
    """Whether checkpoint `cp`'s first layer is that of its tokens, for loaded model `m`
    (models.LoadedModel; None, a VLM or no layers: None, not checkable). `early`: its sample,
    computed ahead (used when it is of cp's tokens)."""
    if m is None or m.vision is not None or not cp.layers:
        return None
    fresh = early is not None and early.caches is not None and early.model_id == id(m.model)
    caches = early.caches if fresh else m.new_caches()  # (never advanced: every pass stops at the first)
    return first_layer_matches(m.model, caches, cp.tokens, cp.layers[0], early)


def first_layer_matches(model: Any, caches: Sequence, tokens: Sequence[int], layer0,
                        early: Ahead | None = None) -> bool | None:
    """True if layer0 (a checkpoint's LayerState 0) holds the first layer's keys and values of
    `tokens` within the dtype's tolerance; False if not; None if this model cannot be checked so.
    `caches`: a fresh cache list of the model (models.new_caches)."""
    if not (_plain(layer0.kind) and _plain(kind_of(caches[0])) and layer0.segments):
        return None
    keys = [s.arrays[0] for s in layer0.segments]
    values = [s.arrays[1] for s in layer0.segments]
    keys = keys[0] if len(keys) == 1 else mx.concatenate(keys, axis=-2)
    values = values[0] if len(values) == 1 else mx.concatenate(values, axis=-2)
    n = int(keys.shape[-2])
    if n != len(tokens) or int(values.shape[-2]) != n:
        return False
    tol = TOLERANCE.get(keys.dtype, (5e-2, 1e-2))
    if not _is_whole_only(model) and n >= 2 * SPAN:
        if early is None or not early.is_of(model, tokens):
            pos = _sample_positions(n)
            early = Ahead(model, tokens, pos, _reference(model, caches, tokens, pos))
        sampled = early.got is not None and _sampled(keys, values, early, tol)
        if sampled:
            return True
    whole = _whole(model, caches, tokens, keys, values, tol)
    if whole and n >= 2 * SPAN:
        _whole_only[id(model)] = weakref.ref(model)  # the sample failed where the whole matched: its rotary code differs
    return whole


def _is_whole_only(model) -> bool:
    """Is `model` one whose sample failed where the whole matched (by identity: an id() is reused
    once a model is freed, and a model mlx-lm loads is not hashable)?"""
    ref = _whole_only.get(id(model))
    return ref is not None and ref() is model


def _close(got, want, tol) -> bool:
    rtol, atol = tol
    return bool(mx.allclose(got.astype(mx.float32), want.astype(mx.float32), rtol=rtol, atol=atol))


def _sample_positions(n: int) -> np.ndarray:
    """SAMPLE consecutive positions at a random place in every SPAN: (rows, SAMPLE). The places come
    from os.urandom (a writer cannot predict them; 10 us where seeding a numpy Generator took 0.5 ms)."""
    starts = np.arange(0, n - SAMPLE + 1, SPAN)
    jitter = np.frombuffer(os.urandom(2 * len(starts)), np.uint16) % (SPAN - SAMPLE + 1)
    starts = np.minimum(starts + jitter, n - SAMPLE)
    return (starts[:, None] + np.arange(SAMPLE)[None, :]).astype(np.int32)


def _reference(model, caches, tokens, pos: np.ndarray) -> tuple | None:
    """The model's first-layer (keys, values) at `pos`, the rows of one batch with their own rotary
    offsets (lazy); None where the forward pass does not take per-row offsets."""
    toks = np.asarray(tokens, dtype=np.int64)[pos]
    cap = Capture(mx.array(pos[:, 0].copy()))
    try:
        model(mx.array(toks.astype(np.int32)), cache=[cap, *caches[1:]])
    except Stop:
        pass
    except Exception:  # noqa: BLE001 - no per-row offsets here: the whole check decides
        return None
    return cap.got


def _sampled(keys, values, early: Ahead, tol) -> bool:
    """Whether the restored keys and values equal the reference at the sampled positions, compared
    as (heads, positions, dim) float32 arrays in numpy (on a busy CPU MLX's take/reshape/transpose
    chain cost 30 ms at 8k; this is ~0.5 ms)."""
    flat = early.pos.reshape(-1)
    for restored, ref in zip((keys, values), early.got):
        ref = np.asarray(ref if ref.dtype == mx.float32 else ref.astype(mx.float32))  # (rows, heads, SAMPLE, dim)
        want = ref.transpose(1, 0, 2, 3).reshape(ref.shape[1], -1, ref.shape[-1])
        got = _positions(restored, flat)
        if got.shape != want.shape or not _all_close(got, want, tol):
            return False
    return True


def _all_close(got: np.ndarray, want: np.ndarray, tol) -> bool:
    """np.allclose(got, want, rtol, atol) for float32 arrays (a NaN is never close, equal infinities
    are: a float16 key that overflows), without its float64 temporaries: ~2/3 of its time at 8k."""
    rtol, atol = tol
    bound = np.abs(want)
    bound *= np.float32(rtol)
    bound += np.float32(atol)
    with np.errstate(invalid="ignore"):  # inf - inf
        diff = np.subtract(got, want)
    np.abs(diff, out=diff)
    return bool(np.all((diff <= bound) | (got == want)))


def _positions(a, flat: np.ndarray) -> np.ndarray:
    """Positions `flat` of a (1, heads, n, dim) array, as float32 (heads, len(flat), dim)."""
    if a.dtype == mx.float32:
        return np.asarray(a)[0][:, flat]
    if a.dtype == mx.float16:
        return np.asarray(a)[0][:, flat].astype(np.float32)
    return np.asarray(mx.take(a, mx.array(flat), axis=2).astype(mx.float32))[0]  # bfloat16: not a numpy dtype


def _whole(model, caches, tokens, keys, values, tol) -> bool | None:
    n = int(keys.shape[-2])
    for start in range(0, n, CHUNK):
        end = min(n, start + CHUNK)
        cap = Capture(start)
        try:
            model(mx.array(list(tokens[start:end]))[None], cache=[cap, *caches[1:]])
        except Stop:
            pass
        except Exception:  # noqa: BLE001 - a forward pass that does not work this way: not checkable
            return None
        if cap.got is None:
            return None
        want_k, want_v = cap.got
        got_k, got_v = keys[..., start:end, :], values[..., start:end, :]
        if want_k.shape != got_k.shape or want_v.shape != got_v.shape:
            return False
        if not (_close(got_k, want_k, tol) and _close(got_v, want_v, tol)):
            return False
    return True
