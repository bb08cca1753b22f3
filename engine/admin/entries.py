"""What `%cache` does over the whole cache: list every entry (prefixes and objects, with their
names and previews), clear RAM or SSD, collect what nothing can use. The Engine's cache_entries,
cache_clear and cache_gc."""

from __future__ import annotations

from ..cache.objects.cache import ObjectCache, is_object_namespace
from ..cache.tiered import TieredPromptCache
from ..events import EventBus
from ..generate.resume import InflightRecords
from ..models.registry import ModelRegistry
from ..named.checkpoints import NamedCheckpoints


def entries(cache: TieredPromptCache, names: NamedCheckpoints, models: ModelRegistry,
            objects: ObjectCache) -> list[dict]:
    """Every RAM and SSD entry as plain data, most recently used first."""
    names_by_key: dict = {}
    for r in names.list():
        names_by_key.setdefault((r["namespace"], tuple(r["tokens"])), []).append(r["name"])
    rows = []
    for row in cache.rows():
        if is_object_namespace(row["ns"]):
            rows.append(objects.row(row))
            continue
        ns, tokens = row.pop("ns"), row.pop("tokens")
        m = models.by_namespace(ns)
        rows.append({
            "kind": "prefix", "model": m.name if m else None, "namespace": ns, "tokens": len(tokens),
            "preview": models.preview(ns, tokens), "pinned": names_by_key.get((ns, tokens), []), **row,
        })
    return sorted(rows, key=lambda r: -(r["last_used"] or 0))


def clear(cache: TieredPromptCache, inflight: InflightRecords, events: EventBus, *, ssd: bool) -> dict:
    """Drop RAM entries (and with ssd, SSD files and resume records); named checkpoints stay."""
    ram = len(cache.entries())
    files_before = cache.stats().get("ssd_files", 0)
    kept = cache.clear(ssd=ssd)
    if ssd:
        for record in inflight.list():
            inflight.finish(record["request"])
    files_removed = files_before - cache.stats().get("ssd_files", 0)
    events.emit("cache_cleared", ram_entries=ram - kept, ssd=ssd)
    return {"ram_entries": ram - kept, "kept_not_durable": kept, "ssd_files": files_removed}


def gc(cache: TieredPromptCache, names: NamedCheckpoints, inflight: InflightRecords, *, dry_run: bool,
       quarantine: bool = False) -> dict:
    """Stale files (quarantined ones with `quarantine`), resume records without their checkpoint
    (removed unless dry_run), and the names whose state is gone (listed)."""
    report = {**cache.gc_files(dry_run, quarantine), "dangling_names": [], "inflight_removed": 0}
    for r in names.list():
        ns, tokens = r["namespace"], tuple(r["tokens"])
        if cache.get_exact(tokens, ns) is None and not cache.on_ssd(tokens, ns):
            report["dangling_names"].append(r["name"])
    committed = cache.ssd_keys()
    for record in inflight.list():
        if (record.get("namespace"), record.get("boundary_key")) not in committed:
            if not dry_run:
                inflight.finish(record["request"])
            report["inflight_removed"] += 1
    return report
