"""The SSD cap: least recently used files go until every process's unique bytes fit the
budget, in short transactions of EVICT_CHUNK files each (as remove() deletes), so a publish
that must evict thousands holds the write lock briefly each time
(benchmarks/bench_evict_lock.py). Pinned and leased files stay."""

from __future__ import annotations

from typing import Protocol

from ..catalog.tables import Catalog
from .removal import AfterCommit, changing
from .store_side import RemovalSide

EVICT_CHUNK = 64  # files decided per transaction


class CapSide(RemovalSide, Protocol):
    ssd_budget_bytes: int | None
    catalog: Catalog

    def _delete(self, db, after: AfterCommit, ns: str, key: str, reason: str) -> bool: ...


def enforce_budget(store: CapSide, db, after: AfterCommit, keep: tuple | None = None,
                   since: tuple = (float("-inf"), 0)) -> tuple | None:
    """Inside a transaction: delete least recently used files used after `since` (never `keep`)
    until the budget is met, at most EVICT_CHUNK of them (the totals are kept by triggers: no
    scan per file). Returns where the next transaction goes on from, or None when done."""
    if store.ssd_budget_bytes is None:
        return None
    deleted = 0
    while store.catalog.total_bytes(db) > store.ssd_budget_bytes:
        page = store.catalog.least_recent(db, since, limit=EVICT_CHUNK)
        if not page:
            return None
        for ns, key, used in page:
            if deleted >= EVICT_CHUNK:
                return since
            since = used
            if (ns, key) != keep:
                deleted += store._delete(db, after, ns, key, "capacity")
            if store.catalog.total_bytes(db) <= store.ssd_budget_bytes:
                return None
    return None


def evict_rest(store: CapSide, keep: tuple | None, since: tuple | None) -> None:
    """Go on with the cap after a transaction that stopped at its chunk (`since`: where)."""
    while since is not None:
        with changing(store, "evict") as (db, after):
            since = enforce_budget(store, db, after, keep, since)
