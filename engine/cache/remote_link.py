"""The remote tier as the tiered cache sees it: a lookup that returns a
Checkpoint, and publication of what the SSD tier committed.

Lookup order is RAM, SSD, remote (tiered.py). A remote prefix is the run of
leading full blocks the remote holds records for (remote/tier.py); it is
fetched only when it is longer than what the local tiers serve and the
measured remote bandwidth beats prefilling those tokens. Each block is
verified by BLAKE3 and copied straight into MLX buffers (ssd/blocks.py),
and the checkpoint is then adopted in RAM and written through to the local
SSD tier by the caller. Any failure is a miss, never a failed generation.

Only checkpoints made entirely of token spans (plain, quantized, unwrapped
sliding-window and unchunked layers, no attachments) go remote: their state
at any block boundary is a cut of the same tensors. Remote blocks are the
SSD blocks (same grid, same names): at 32 tokens a SmolLM2 block is 1.5 MB,
where Redis GETs run at full speed (docs/benchmarks.md).

Publication runs after a local commit (the writer thread calls `published`):
it queues a job on the remote publisher, which reads the block files and
uploads only blocks the remote lacks. Owner thread for `lookup`.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..kv.checkpoint import Checkpoint
from ..kv.codecs import layout_at
from .remote.tier import RemoteMiss, RemoteTier
from .ssd import blocks
from .ssd import format as fmt
from .ssd.blocks import CorruptBlock
from .ssd.restore import empty_buffer

PUBLISH_MODES = ("all", "named", "none")
DEFAULT_PREFILL_TOKENS_PER_S = 100.0  # until this namespace's prefill rate is measured


class RemoteLink:
    def __init__(self, tier: RemoteTier, *, publish: str = "all",
                 prefill_rate: Callable[[str], float | None] = lambda ns: None,
                 is_named: Callable[[str, tuple], bool] = lambda ns, tokens: False):
        if publish not in PUBLISH_MODES:
            raise ValueError(f"remote publish must be one of {', '.join(PUBLISH_MODES)}, not {publish!r}")
        self.tier, self.publish_mode = tier, publish
        self.prefill_rate, self.is_named = prefill_rate, is_named
        self.counters = {f"remote_{k}": 0 for k in link_counter_names()}
        self.counters["remote_fetch_seconds"] = 0.0

    # --- lookup (owner thread) ---

    def lookup(self, prompt: Sequence[int], ns: str, have: int) -> Checkpoint | None:
        """A checkpoint of the longest remote prefix of `prompt` (at most len-1 tokens)
        if it is longer than `have` and worth fetching; None otherwise."""
        bt = blocks.BLOCK_TOKENS
        cap = len(prompt) - 1
        if cap // bt * bt - have < self.tier.min_fetch_tokens:  # too short to beat a prefill: no round trip
            return None
        records = self.tier.probe(ns, prompt[: cap // bt * bt], bt)
        if not records or records[-1].end <= have:
            return None
        layout = records[-1].layout
        try:  # signed by a team member, but maybe by another build: a layout we cannot use is a miss
            specs = [(str(name), str(dtype), tuple(int(x) for x in shape)) for name, dtype, shape in layout["tensors"]]
            per_token = sum(int(np.prod(s[:-2] + s[-1:])) * fmt.host_dtype(d).itemsize for _, d, s in specs)
        except (KeyError, TypeError, ValueError) as e:
            self.counters["remote_misses"] += 1
            raise RemoteMiss(f"remote record has an unusable layout: {e}") from None
        rate = self.prefill_rate(ns) or DEFAULT_PREFILL_TOKENS_PER_S
        if not self.tier.worth_fetching(records[-1].end - have, per_token, rate, block_size=bt):
            self.counters["remote_skipped"] += 1
            return None
        t0 = time.perf_counter()
        try:
            values = self.tier.get_blocks([r.block for r in records])
        except RemoteMiss as e:  # a shorter run of verified blocks may still be worth it
            values = e.blocks
            self.counters["remote_misses"] += 1
        n = len(values) * bt
        if n <= have:
            return None
        try:
            cp = self._build(prompt[:n], layout, specs, values, [r.block for r in records])
        except (CorruptBlock, ValueError, KeyError, TypeError, AttributeError) as e:
            self.counters["remote_misses"] += 1
            raise RemoteMiss(f"remote blocks do not rebuild a checkpoint: {e}") from None
        self.counters["remote_hits"] += 1
        self.counters["remote_tokens"] += n
        self.counters["remote_fetch_seconds"] += time.perf_counter() - t0
        return cp

    @staticmethod
    def _build(tokens, layout: dict, specs: list, values: list[bytes], names: list[str]) -> Checkpoint:
        n, bt = len(tokens), blocks.BLOCK_TOKENS
        arrays, views = {}, []
        for name, dtype, shape in specs:  # MLX buffers the blocks are copied into
            full = (*shape[:-2], n, shape[-1])
            a = empty_buffer(dtype, full)
            arrays[name] = (a, dtype)
        mx.eval([a for a, _ in arrays.values()])
        views = [np.asarray(a) for a, _ in arrays.values()]
        for i, (value, name) in enumerate(zip(values, names)):
            a, b = i * bt, (i + 1) * bt
            head = blocks.header(a, b, specs)  # the span's shape does not depend on n
            blocks.fill_from_value(value, name, head, [v[..., a:b, :] for v in views])
        tensors = {k: a.view(mx.bfloat16) if d == "bfloat16" else a for k, (a, d) in arrays.items()}
        return Checkpoint.from_tensors(tokens, layout_at(layout["layers"], n), tensors)

    # --- publication (writer thread) ---

    def published(self, info: fmt.FileInfo, blocks_root) -> None:
        """After a local commit: queue the checkpoint's full blocks for the remote."""
        h = info.header
        if self.publish_mode == "none" or h.inline or not h.blocks or not h.trimmable or h.min_reusable_offset:
            return
        if self.publish_mode == "named" and not self.is_named(h.namespace, h.tokens):
            return
        bt = blocks.BLOCK_TOKENS
        full = [b for b in h.blocks if b.end - b.start == bt and b.start % bt == 0]
        if not full or full[0].start != 0:
            return
        layout = {"tensors": [[t.name, t.dtype, list(t.shape[:-2]) + [bt, t.shape[-1]]] for t in h.span_tensors],
                  "layers": h.layout}
        getters = [(b.name, (lambda p=blocks.block_path(blocks_root, b.name): p.read_bytes())) for b in full]
        if self.tier.publish(h.namespace, h.tokens, bt, getters, layout):
            self.counters["remote_published"] += 1

def attach(cache, url: str, *, secret: str | bytes | None = None, publish: str = "all", salt: str = "",
           prefill_rate: Callable[[str], float | None] = lambda ns: None) -> RemoteLink:
    """Connect `cache` (a TieredPromptCache) to a remote tier: lookups fall back to it,
    committed checkpoints are published to it. A bad URL raises ValueError (redacted)."""
    secret = secret.encode() if isinstance(secret, str) else secret
    link = RemoteLink(RemoteTier(url, secret=secret or None, salt=salt), publish=publish, prefill_rate=prefill_rate,
                      is_named=lambda ns, tokens: cache.store is not None and cache.store.is_pinned(ns, tokens))
    cache.remote = link
    if cache.writer is not None:
        cache.writer.on_committed = lambda info: link.published(info, cache.store.blocks_root)
    return link


def flush(link: RemoteLink | None, timeout: float | None) -> list[str]:
    """Wait for queued publications; their failures (credentials removed)."""
    return [] if link is None else link.tier.wait(timeout)


_TIER_KEYS = ("publish_pending", "publish_failed", "blocks_uploaded", "blocks_skipped", "bytes_read", "bytes_written",
              "mac_rejected", "errors", "get_bandwidth_bytes_per_s")


def remote_stats(link: RemoteLink | None) -> dict:
    """The remote_* keys of Engine.stats() (metrics.SCHEMA): zeros and None while the tier is off."""
    if link is None:
        out = {f"remote_{k}": 0 for k in (*link_counter_names(), *_TIER_KEYS)}
        out.update(remote_url=None, remote_publish=None, remote_state=None, remote_last_error=None,
                   remote_get_bandwidth_bytes_per_s=None, remote_fetch_seconds=0.0)
        return out
    t = link.tier.stats()
    out = dict(link.counters)
    out.update({f"remote_{k}": t.get(k) for k in _TIER_KEYS})
    out.update(remote_url=t["url"], remote_publish=link.publish_mode, remote_state=t["breaker"],
               remote_last_error=t["last_error"])
    return out


def link_counter_names() -> tuple:
    return ("hits", "tokens", "misses", "skipped", "published")

