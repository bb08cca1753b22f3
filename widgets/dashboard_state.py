"""What the residency dashboard knows, apart from how it looks: the counters
it shows (read straight from `engine.stats()` keys), the recent-event log,
and the snapshot/dirty bookkeeping shared between the thread that emits
events and the thread that owns the widgets.

Plain Python; no widgets, no HTML, no MLX.
"""

from __future__ import annotations

import threading
from collections import deque

__all__ = ["COUNTERS", "LOG_TYPES", "DashboardState", "counters_from_stats"]

# Events that the log keeps.
LOG_TYPES = ("evict", "demote", "supersede", "quarantine", "write_failed", "restore_failed", "restore_skipped", "remove")

# (label, name, the engine.stats() keys it adds up, kind: n = count, s = seconds, b = bytes,
# r = the first key over the second, a rate; None before there is any).
# The names are the dashboard's public ones (`counters[...]`, the HTML's data-name).
COUNTERS = [
    ("RAM hits", "ram_hits", ("hits",), "n"),
    ("SSD hits", "ssd_hits", ("ssd_hits",), "n"),
    ("misses", "misses", ("misses",), "n"),
    ("object hits", "object_hits", ("object_ram_hits", "object_ssd_hits"), "n"),
    ("object misses", "object_misses", ("object_misses",), "n"),
    ("prompt tokens saved", "tokens_saved", ("engine_cached_tokens",), "n"),
    ("prefill saved", "prefill_s_saved", ("engine_prefill_s_saved",), "s"),
    ("bytes written", "bytes_written", ("bytes_written",), "b"),
    ("bytes deduplicated", "bytes_deduplicated", ("ssd_bytes_deduplicated",), "b"),
    ("bytes read", "bytes_read", ("ssd_restore_bytes",), "b"),
    ("prefetched", "prefetched", ("prefetches_completed",), "n"),
    ("writes committed", "writes_committed", ("writes_committed",), "n"),
    ("failures", "failures", ("writes_failed", "ssd_restore_failures"), "n"),
    ("quarantined", "quarantined", ("ssd_quarantined",), "n"),
    ("evictions", "evictions", ("evictions", "oversized"), "n"),
    ("demotions", "demotions", ("demotions",), "n"),
    ("draft proposed", "draft_proposed", ("engine_draft_tokens_proposed",), "n"),
    ("draft accepted", "draft_accepted", ("engine_draft_tokens_accepted",), "n"),
    ("acceptance", "draft_acceptance", ("engine_draft_tokens_accepted", "engine_draft_tokens_proposed"), "r"),
]


def counters_from_stats(stats: dict) -> dict:
    """Each counter of COUNTERS: the sum of its stats keys (a missing or None key counts 0)."""
    out = {}
    for _, name, keys, kind in COUNTERS:
        if kind == "r":
            num, den = (stats.get(k) or 0 for k in keys)
            out[name] = num / den if den else None
            continue
        total = sum(stats.get(k) or 0 for k in keys)
        out[name] = float(total) if kind == "s" else total
    return out


def snapshot(items) -> list:
    """list() of a deque that another thread may append to meanwhile."""
    for _ in range(5):
        try:
            return list(items)
        except RuntimeError:  # mutated during iteration
            continue
    return []


class DashboardState:
    """The log, counters and last snapshot of one dashboard.

    `record()` may run on any thread; everything else on the owner thread.
    The lock guards the log and the dirty flag.
    """

    def __init__(self, log_size: int = 50):
        self.lock = threading.Lock()
        self.log: deque = deque(maxlen=log_size)
        self.dirty = True
        self.events_seen = 0
        self.stats: dict = {}
        self.entries: list = []
        self.counters: dict = {}

    def seed(self, recent) -> None:
        """Start the log from the engine's recent events."""
        for ev in snapshot(recent):
            if ev.get("type") in LOG_TYPES:
                self.log.append(dict(ev))

    def record(self, event: dict) -> None:
        """Count an event, keep it if the log shows its type, mark the view dirty (any thread)."""
        with self.lock:
            self.events_seen += 1
            if event.get("type") in LOG_TYPES:
                self.log.append(dict(event))
            self.dirty = True

    def mark_dirty(self) -> None:
        with self.lock:
            self.dirty = True

    def log_items(self, *, clean: bool = False) -> list:
        """The log as a list; with clean=True also clear the dirty flag (a full refresh)."""
        with self.lock:
            if clean:
                self.dirty = False
            return list(self.log)

    def update(self, stats: dict, entries: list | None = None) -> None:
        """Take a new stats snapshot (and entries, on a full refresh)."""
        self.stats = stats
        self.counters = counters_from_stats(stats)
        if entries is not None:
            self.entries = list(entries)
