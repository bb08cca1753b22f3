"""A restored state checked against the model: recomputed in short steps (idle-time verification),
or sampled at a few positions through every layer (the fetch-time check).

A state fetched from the team tier is someone else's arithmetic. The first-layer
check (first_layer.py) binds layer 0 to the tokens; deeper layers can only be
checked by computing them, which is what a hit saves. So:

- `Recomputation` prefills the same tokens into fresh caches, a few dozen
  tokens per `step()` (each step ~STEP_S, so a cell that starts meanwhile
  waits one step at most), and after each step compares every layer's keys and
  values at the positions just computed with the restored ones. A state the
  model would not have computed is found at its first wrong (layer, position).
- `sampled_check` recomputes k random positions p through every layer, each
  attending over the restored cache before p: a state that is self-consistent
  at p in every layer. A writer who poisoned a single position evades it with
  probability 1 - k/n.

Equal means within chunk noise: a cold run with another prefill chunk (or
another BLAS) rounds differently, so per position the relative L2 error of
each layer's keys and values (over heads and head dim) must stay under
TOLERANCE for the dtype (docs/team-tier.md#numerics-what-equal-means). Integer
arrays (quantized KV's packed values) are not compared; their scales and biases
are. Owner thread (MLX).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
import mlx.core as mx
import numpy as np

from .codecs import UnsupportedCache, capture_layer, codec
from .first_layer import _plain  # (is a layer kind plain KV: one definition)

# Per-position relative L2 error allowed, by dtype: a cold run with another prefill chunk stays well
# under it (measured: benchmarks/bench_remote_verify.py reports the largest error of an honest state).
TOLERANCE = {mx.float32: 1e-3, mx.float16: 2e-2, mx.bfloat16: 5e-2}
STEP_S = 0.03  # a step's target duration: what a cell arriving mid-verification waits at most (~)
MIN_STEP_TOKENS, MAX_STEP_TOKENS = 8, 512
SAMPLED_POSITIONS = 4  # k: positions the fetch-time check recomputes through every layer


@dataclass(frozen=True)
class Mismatch:
    layer: int
    position: int  # -1: a whole-state layer (recurrent, a wrapped window) compared at the end
    error: float  # the relative L2 error there


def _tolerance(dtype) -> float:
    return TOLERANCE.get(dtype, 5e-2)


def _positional(layer) -> bool:
    """Is this layer's state segments along the token axis (compared per position)?"""
    try:
        c = codec(layer.kind)
    except UnsupportedCache:
        return False
    return bool(c.segmented and c.linear(layer.meta) and not layer.parts)


def _span(slot: list, start: int, end: int):
    """Positions [start, end) of one array given as its segments along the token axis."""
    out, at = [], 0
    for a in slot:
        n = int(a.shape[-2])
        lo, hi = max(start, at), min(end, at + n)
        if lo < hi:
            out.append(a[..., lo - at:hi - at, :])
        at += n
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=-2)


def _errors(got, want) -> mx.array:
    """Relative L2 error per position of (..., positions, dim) arrays (lazy)."""
    axes = [i for i in range(want.ndim) if i != want.ndim - 2]
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    diff = mx.sqrt(mx.sum(mx.square(g - w), axis=axes))
    return diff / (mx.sqrt(mx.sum(mx.square(w), axis=axes)) + 1e-6)


def _first_bad(errs: list, tols: list, offset: int) -> Mismatch | None:
    """The first (layer, position) over tolerance among evaluated error rows [(layer, errors)]."""
    for (layer, e), tol in zip(errs, tols):
        e = np.asarray(e)
        bad = np.flatnonzero(~(e <= tol))  # (a NaN is bad)
        if bad.size:
            return Mismatch(layer, offset + int(bad[0]), float(e[bad[0]]))
    return None


class Recomputation:
    """The prefill of a restored checkpoint's tokens, a step at a time, compared as it goes."""

    def __init__(self, m, cp):
        self.forward, self.cp, self.tokens = m.forward, cp, list(cp.tokens)
        self.caches = m.new_caches()
        self.done, self.seconds, self.chunk = 0, 0.0, 32
        self.mismatch: Mismatch | None = None
        self.max_error = 0.0  # the largest relative error seen (what an honest state's noise amounts to)

    @property
    def finished(self) -> bool:
        return self.mismatch is not None or self.done >= len(self.tokens)

    def step(self) -> None:
        """Forward the next chunk and compare its positions (whole-state layers: after the last)."""
        if self.finished:
            return
        t0 = time.perf_counter()
        start, end = self.done, min(len(self.tokens), self.done + self.chunk)
        self.forward(mx.array(self.tokens[start:end])[None], cache=self.caches)
        errs, tols = [], []
        for i, (c, restored) in enumerate(zip(self.caches, self.cp.layers)):
            if _positional(restored):
                fresh = capture_layer(c, False).slots()
                pairs = [(_span(f, start, end), _span(r, start, end)) for f, r in zip(fresh, restored.slots())]
            elif end == len(self.tokens):
                fresh = capture_layer(c, False).arrays
                pairs = list(zip(fresh, restored.arrays))
            else:
                continue
            for got, want in pairs:
                if mx.issubdtype(want.dtype, mx.floating) and got.shape == want.shape and want.ndim >= 2:
                    errs.append((i, _errors(got, want)))
                    tols.append(_tolerance(want.dtype))
                elif got.shape != want.shape:  # a state of another shape is not this one
                    self.mismatch = Mismatch(i, -1, float("inf"))
        mx.eval([e for _, e in errs])
        if self.mismatch is None:
            self.mismatch = _first_bad(errs, tols, start)
            self.max_error = max([self.max_error] + [float(mx.max(e).item()) for _, e in errs if e.size])
        self.done = end
        dt = time.perf_counter() - t0
        self.seconds += dt
        rate = (end - start) / max(dt, 1e-4)  # the next chunk takes ~STEP_S at this rate
        self.chunk = int(min(MAX_STEP_TOKENS, max(MIN_STEP_TOKENS, rate * STEP_S)))


class _Restored:
    """A plain KV cache over the restored keys and values: the forward of the token at `offset`
    computes its keys and values (kept in `got`) and attends over the restored ones up to it,
    its own included, without copying them."""

    def __init__(self, keys, values, offset: int):
        self.keys_all, self.values_all, self.offset = keys, values, offset
        self.got = None

    def make_mask(self, n: int, *args, **kwargs):
        return None

    def update_and_fetch(self, keys, values):
        self.got = (keys, values)
        p = self.offset + int(keys.shape[-2])
        return self.keys_all[..., :p, :], self.values_all[..., :p, :]


def sampled_check(m, cp, k: int = SAMPLED_POSITIONS) -> Mismatch | bool | None:
    """Recompute k random positions of `cp` through every layer from its restored cache: True if
    each layer's keys and values there equal the restored ones (within TOLERANCE), the first
    Mismatch if not, None where the check does not apply (a layer not plain KV, a VLM, too short)."""
    n = len(cp)
    if m is None or getattr(m, "vision", None) is not None or n < 2 or not cp.layers:
        return None
    if not all(not l.parts and _plain(l.kind) and l.segments for l in cp.layers):
        return None
    joined = [tuple(mx.concatenate(s, axis=-2) if len(s) > 1 else s[0] for s in l.slots()) for l in cp.layers]
    positions = sorted(int(p) for p in (np.frombuffer(os.urandom(4 * k), np.uint32) % (n - 1) + 1))  # never 0
    errs, tols = [], []
    for p in positions:
        caches = [_Restored(kv[0], kv[1], p) for kv in joined]
        try:
            m.model(mx.array([[cp.tokens[p]]]), cache=caches)
        except Exception:  # noqa: BLE001 - a forward pass that does not take such caches: not checkable
            return None
        for i, (c, kv) in enumerate(zip(caches, joined)):
            if c.got is None:
                return None
            for got, want in zip(c.got, kv):
                errs.append(((i, p), _errors(got, want[..., p:p + 1, :])))
                tols.append(_tolerance(want.dtype))
    mx.eval([e for _, e in errs])
    for ((layer, p), e), tol in zip(errs, tols):
        v = float(np.asarray(e)[0])
        if not v <= tol:
            return Mismatch(layer, p, v)
    return True


def describe(m: Mismatch) -> str:
    where = "its whole state" if m.position < 0 else f"position {m.position}"
    return f"layer {m.layer}, {where} (relative error {m.error:.3g})"


