"""Each passage's KV, computed once on its own after the lead-in, kept as an exact-key object.

The object (`Engine.objects`, cache/objects/) is keyed by everything its numbers depend on: the
model's namespace (weights, config, tokenizer, KV scheme, versions), the lead-in's and the
passage's token ids, and `REVISION`; its value is the keys and values of every layer at the
passage's positions (the lead-in's own are not kept). So it rides on every tier as objects do:
RAM, then SSD (verified, after a restart too), then the team tier; `%cache ls` lists it under
the label "passage". An object never serves as a prompt prefix, which is what approximate state
must never do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...kv.caches import holding, kv_arrays
from ..prefill import prefill

REVISION = 1  # of what a passage object holds
LABEL = "passage"


@dataclass
class PassageKV:
    keys: list  # per layer (1, kv heads, n, head dim), at positions len(lead_in) .. len(lead_in) + n - 1
    values: list
    source: str  # "ram" | "ssd" | "remote" | "encoded"

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[-2])


@dataclass
class Encoded:
    """What encoding the passages the tiers did not hold cost."""

    passages: int = 0
    tokens: int = 0
    seconds: float = 0.0


def object_key(m, lead_in: list, tokens: list) -> tuple:
    return ("passage-kv", REVISION, m.namespace, np.asarray(lead_in, dtype=np.int64),
            np.asarray(tokens, dtype=np.int64))


def passage_states(m, objects, lead_in: list, passages: list, *, chunk: int) -> tuple[list, Encoded]:
    """The KV of each passage (token id lists), in order: from the tiers, or encoded and stored there.
    objects: the engine's ObjectCache, or None (the cache is off: encoded, not stored)."""
    found: dict = {}
    encoded, lead = Encoded(), None
    for tokens in passages:
        k = tuple(tokens)
        if k in found:  # the same passage twice: one state (placed twice)
            continue
        key = object_key(m, lead_in, tokens)
        value, source = objects.lookup(key) if objects is not None else (None, None)
        if source is not None:
            found[k] = PassageKV(list(value["keys"]), list(value["values"]), source)
            continue
        t0 = time.perf_counter()
        if lead is None:
            lead = _lead_state(m, lead_in, chunk)
        keys, values = _encode(m, lead, len(lead_in), tokens, chunk)
        encoded.passages, encoded.tokens = encoded.passages + 1, encoded.tokens + len(tokens)
        encoded.seconds += time.perf_counter() - t0
        found[k] = PassageKV(keys, values, "encoded")
        if objects is not None:
            objects.put(key, {"keys": keys, "values": values}, label=LABEL)
    return [found[tuple(t)] for t in passages], encoded


def _lead_state(m, lead_in: list, chunk: int) -> list:
    """Per layer (keys, values) of the lead-in alone ([] for no lead-in)."""
    if not lead_in:
        return []
    caches = m.new_caches()
    prefill(m.model, caches, lead_in, chunk=chunk)
    return [kv_arrays(c) for c in caches]


def _encode(m, lead: list, n_lead: int, tokens: list, chunk: int) -> tuple[list, list]:
    """The passage prefilled after the lead-in; its own positions' keys and values, compact."""
    fresh = m.new_caches()
    caches = [holding(c, k, v) for c, (k, v) in zip(fresh, lead)] if lead else fresh
    prefill(m.model, caches, tokens, chunk=chunk)
    keys, values = [], []
    for c in caches:
        k, v = kv_arrays(c)
        keys.append(mx.contiguous(k[..., n_lead:, :]))
        values.append(mx.contiguous(v[..., n_lead:, :]))
    mx.eval(keys, values)
    return keys, values
