"""Passages placed into a prompt's KV, and the tokens where that shortcut matters recomputed.

`place`: after the exact prefix, each passage's stored KV goes to its positions, its keys
rotated there (moves.py). What a placed passage lacks is attention to what came before it
in this prompt (it saw only the lead-in). `choose` picks the tokens to recompute, a fraction
of the placed ones, as CacheBlend (Yao et al., EuroSys 2025) and EPIC (Hu et al., 2024) do:
first the first tokens of each passage (where attention sinks form: EPIC), then the tokens
whose KV moves most when recomputed, measured at layer `DEVIATION_LAYER` (the first layer whose
KV depends on other tokens; CacheBlend's selection) by `deviations`, a forward of every placed
token through the layers up to that one (which leaves the layers before it recomputed for every
token: a full prefill's, for the price already paid). `recompute` then runs the model's own forward pass over
the chosen tokens only, at their positions: at every layer they write fresh keys and values and
attend, causally, over the whole prompt's KV as it stands (fresh where recomputed, placed
elsewhere). Chosen tokens go in chunks in position order, which is what recomputing them all at
once computes: a token attends only to positions before it.

Recomputing every placed token is a full prefill (within float rounding); none leaves each
passage's own encoding, moved.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...kv.first_layer import Capture, Stop
from .moves import Mover

LEAD_TOKENS = 2  # first tokens of each passage, chosen before any by deviation (bench_passages: 8 did worse)
DEVIATION_LAYER = 1
CHUNK = 128  # placed positions per forward: each chunk attends up to its own last position (a 2.3k-token
# prompt: 128 placed it in 0.55-0.7 of the time 512 took, on vm2)


@dataclass
class Layout:
    keys: list  # per layer (1, kv heads, n, head dim): positions [0, n)
    values: list
    exact: int  # positions [0, exact) are what a full prefill computes
    spans: list  # (start, end) of the placed positions, each passage's part after `exact`, in order

    @property
    def placed(self) -> int:
        return sum(e - s for s, e in self.spans)


def place(mover: Mover, prefix: list, exact: int, spans: list, states: list, n_lead: int) -> Layout:
    """prefix: per layer (keys, values) holding [0, exact) (None, None: nothing); spans: each passage's
    (start, end) in the prompt; states: their PassageKV, computed after n_lead lead-in tokens."""
    keys = [[k[..., :exact, :]] if exact else [] for k, _ in prefix]
    values = [[v[..., :exact, :]] if exact else [] for _, v in prefix]
    placed = []
    for (s, e), kv in zip(spans, states):
        if e <= exact:
            continue
        a = max(s, exact)
        placed.append((a, e))
        for i in range(len(keys)):
            keys[i].append(mover.rotate(i, kv.keys[i][..., a - s:, :], s - n_lead))
            values[i].append(kv.values[i][..., a - s:, :])
    keys = [mx.concatenate(k, axis=-2) if len(k) > 1 else k[0] for k in keys]
    values = [mx.concatenate(v, axis=-2) if len(v) > 1 else v[0] for v in values]
    mx.eval(keys, values)
    return Layout(keys, values, exact, placed)


class _Blend:
    """One layer's KV of the prompt while chosen positions are recomputed. write: the fresh keys and
    values replace the placed ones; else they are seen in this forward only."""

    offset = 0  # (positions come from Mover.at)

    def __init__(self, keys: mx.array, values: mx.array, write: bool):
        self.keys, self.values, self.write = keys, values, write
        self.pos = self.mask = None
        self.limit = 0

    def aim(self, pos: mx.array, limit: int, mask: mx.array) -> None:
        self.pos, self.limit, self.mask = pos, limit, mask

    def make_mask(self, n: int, *args, **kwargs):
        return self.mask

    def update_and_fetch(self, keys, values):
        if self.write:
            self.keys[..., self.pos, :] = keys
            self.values[..., self.pos, :] = values
            return self.keys[..., : self.limit, :], self.values[..., : self.limit, :]
        k, v = self.keys[..., : self.limit, :], self.values[..., : self.limit, :]
        k[..., self.pos, :] = keys
        v[..., self.pos, :] = values
        return k, v


def _forward(model, mover: Mover, caches: list, tokens: list, positions: list) -> None:
    """The model's forward pass over `tokens` at `positions` (ascending) with these layer caches."""
    pos = mx.array(positions, dtype=mx.int32)
    limit = positions[-1] + 1
    mask = pos[:, None] >= mx.arange(limit)[None]
    for c in caches:
        if isinstance(c, _Blend):
            c.aim(pos, limit, mask)
    with mover.at(positions):
        model(mx.array(tokens)[None], cache=caches)


def deviations(model, mover: Mover, layout: Layout, tokens: list, chunk: int = CHUNK) -> dict:
    """Position -> how far its KV at DEVIATION_LAYER moves when recomputed over the prompt (relative
    squared difference of keys and values), for every placed position. The layers before it are
    recomputed for every placed token on the way (in place in `layout`): they are a full prefill's."""
    layer = min(DEVIATION_LAYER, len(layout.keys) - 1)
    positions = [p for s, e in layout.spans for p in range(s, e)]
    out = {}
    before = [_Blend(k, v, write=True) for k, v in zip(layout.keys[:layer], layout.values[:layer])]
    for at in range(0, len(positions), chunk):
        part = positions[at : at + chunk]
        stop = Capture(0)
        caches = before + [stop] * (len(layout.keys) - layer)
        try:
            _forward(model, mover, caches, [tokens[p] for p in part], part)
        except Stop:
            pass
        idx = mx.array(part, dtype=mx.int32)
        k, v = stop.got
        old_k, old_v = layout.keys[layer][..., idx, :], layout.values[layer][..., idx, :]
        moved = ((k - old_k).square().sum(axis=(0, 1, 3)) / (old_k.square().sum(axis=(0, 1, 3)) + 1e-9)
                 + (v - old_v).square().sum(axis=(0, 1, 3)) / (old_v.square().sum(axis=(0, 1, 3)) + 1e-9))
        out.update(zip(part, moved.tolist()))
    layout.keys[:layer] = [c.keys for c in before]
    layout.values[:layer] = [c.values for c in before]
    return out


def choose(layout: Layout, fraction: float, moved: dict | None = None) -> list:
    """The positions to recompute: `fraction` of the placed ones (rounded), the first LEAD_TOKENS of
    each passage first (rank by rank across passages), then the most moved. Ascending."""
    total = layout.placed
    budget = min(total, round(fraction * total))
    if budget >= total:
        return [p for s, e in layout.spans for p in range(s, e)]
    chosen: list = []
    for rank in range(LEAD_TOKENS):
        chosen += [s + rank for s, e in layout.spans if s + rank < e]
    chosen = chosen[:budget]
    if len(chosen) < budget and moved:
        taken = set(chosen)
        ranked = sorted((p for p in moved if p not in taken), key=lambda p: -moved[p])
        chosen += ranked[: budget - len(chosen)]
    return sorted(chosen)


def needs_deviations(layout: Layout, fraction: float) -> bool:
    """Whether `choose` picks beyond the first tokens of each passage (and short of all of them)."""
    total = layout.placed
    budget = min(total, round(fraction * total))
    leads = sum(min(LEAD_TOKENS, e - s) for s, e in layout.spans)
    return leads < budget < total


def recompute(model, mover: Mover, layout: Layout, tokens: list, positions: list, chunk: int = CHUNK) -> None:
    """Recompute `positions` (ascending) at every layer, in place in `layout`."""
    if not positions:
        return
    caches = [_Blend(k, v, write=True) for k, v in zip(layout.keys, layout.values)]
    for at in range(0, len(positions), chunk):
        part = positions[at : at + chunk]
        _forward(model, mover, caches, [tokens[p] for p in part], part)
        mx.eval([a for c in caches for a in (c.keys, c.values)])
    layout.keys = [c.keys for c in caches]
    layout.values = [c.values for c in caches]
