"""Loans in place: the RAM entries sharing a document's buffers step aside while one generation
appends into them, and take them back when it is done.

A second question over a cached document borrows the document's first n positions. Lent as views,
its first append copies all n into a buffer of its own (MLX never writes a buffer that other arrays
still view): a second at a gigabyte. Lent in place, it appends into the document's own buffers from
position n on, as mlx-lm's KVCache holding the document with room would (the floor):

1. every RAM entry whose first segment views those buffers (the document's, earlier questions')
   steps aside: out of the RAM tier, its views dropped, its positions past n (an earlier question
   and answer: few) copied out first;
2. the generation's caches take the buffers over (`Checkpoint.hand_over(n, keep=n)`) and never
   write below n;
3. when its loan ends (`Loan.release`, also after an error or an interrupt) each entry comes back
   over the buffers as they are then (the same memory, or the larger buffer they grew into), and
   what the generation publishes shares those n positions with them (`BorrowedKVCache.share_back`).

Only where nothing else could see the buffers change hands and it pays: plain KV whose first n
positions are in each layer's first segment, no holder lent out, the positions copied out at most
COPY_SHARE of n, and every holder's queued write stopped (its numpy views would make MLX copy the
buffers anyway; `ResidencyRules.may_step_aside`: the entry comes back dirty and is written again).
"""

from __future__ import annotations

import mlx.core as mx

from ..kv.borrowed import Segment
from ..kv.checkpoint import Checkpoint
from ..kv.layers import LayerState, own
from .entry import Entry, Loan

COPY_SHARE = 0.25  # positions copied out of the holders at most this share of the n lent in place


def lend_in_place(ram, entry: Entry, n: int, source: str) -> Loan | None:
    """A loan of `entry`'s first n positions whose caches append into its buffers, or None where
    one does not apply (the caller lends views). `ram`: the RamTier `entry` is in."""
    holders = _holders(ram, entry, n)
    if holders is None:
        return None
    kept = []  # per holder, per layer: (kind, meta, positions it keeps of the buffers, its segments after them)
    for h in holders:
        layers = []
        for layer in h.checkpoint.layers:  # (nothing kept here may view the buffers: MLX would copy them)
            first, rest = layer.segments[0], tuple(layer.segments[1:])
            if first.length > n:  # its own positions past n: the borrower writes there
                rest = own(tuple(a[..., n:, :] for a in first.arrays), (), True) + rest
            layers.append((layer.kind, layer.meta, min(first.length, n), rest))
        kept.append(layers)
    mx.eval([a for layers in kept for *_, rest in layers for s in rest for a in s.arrays])  # before any write
    caches = entry.checkpoint.hand_over(n, in_place=True, keep=n)
    for h in holders:
        ram.forget(h)
        h.checkpoint = Checkpoint(h.tokens, (), 0)  # its views go: the borrower's appends stay in place

    def give_back(_: Entry) -> None:
        shared = [c.share_back() for c in caches]
        for h, layers in zip(holders, kept):
            h.checkpoint = Checkpoint.of_layers(h.tokens, tuple(
                LayerState(kind, (_first(seg, k),) + rest, meta) for seg, (kind, meta, k, rest) in zip(shared, layers)))
            ram.readmit(h)

    return Loan(entry, n, source, give_back, caches=caches)


def _first(shared: Segment, k: int) -> Segment:
    """The first k positions of the shared segment, over its buffers (they stay its parents)."""
    if k == shared.length:
        return shared
    return Segment(tuple(p[..., :k, :] for p in shared.parents), shared.buffer, shared.parents)


def _holders(ram, entry: Entry, n: int) -> list | None:
    """Every RAM entry viewing the buffers that hold `entry`'s first n positions (`entry` among
    them), if all of them may step aside and the copies pay; else None."""
    cp = entry.checkpoint
    if not (cp.can_hand_over and 0 < n <= len(cp.tokens)):
        return None
    firsts = [l.segments[0] if l.segments else None for l in cp.layers]
    if any(s is None or not s.parents or s.length < n for s in firsts):
        return None
    ids = {id(s.buffer) for s in firsts}
    holders, copied = [], 0
    for e in ram.entries():
        layers = e.checkpoint.layers
        if not any(id(s.buffer) in ids for l in layers for s in l.segments):
            continue
        if len(layers) != len(firsts) or e.borrowers or not e.checkpoint.can_hand_over:
            return None
        for layer, first in zip(layers, firsts):
            if layer.segments[0].buffer is not first.buffer or any(id(s.buffer) in ids for s in layer.segments[1:]):
                return None
        copied += max(0, layers[0].segments[0].length - n)
        holders.append(e)
    if entry not in holders or copied > COPY_SHARE * n:
        return None
    return holders if all(ram.rules.may_step_aside(h) for h in holders) else None  # (last: it may stop writes)
