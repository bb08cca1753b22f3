"""What `%cache` does over the whole cache (`eng.admin`): list every entry (prefixes and objects,
with their names and previews), clear RAM or SSD, collect what nothing can use, verify the SSD
files, wait for queued writes."""

from __future__ import annotations

from typing import Callable

from ..cache.objects.cache import ObjectCache, is_object_namespace
from ..cache.tiered import TieredPromptCache
from ..events import EventBus
from ..generate.resume import InflightRecords
from ..models.registry import ModelRegistry
from ..named.checkpoints import NamedCheckpoints


class CacheAdmin:
    def __init__(self, *, cache: TieredPromptCache, names: NamedCheckpoints, models: ModelRegistry,
                 objects: ObjectCache, inflight: InflightRecords, events: EventBus,
                 poll: Callable[[], None], flush: Callable[..., dict]):
        """poll and flush: the engine's (apply finished background work; wait for durable writes)."""
        self.cache, self.names, self.models, self.objects = cache, names, models, objects
        self.inflight, self.events, self.poll, self.flush = inflight, events, poll, flush

    def entries(self, poll: bool = True) -> list[dict]:
        """Every RAM and SSD entry as plain data (no MLX arrays are read), most recently used
        first: prompt prefixes (kind "prefix") and objects (kind "object", see ObjectCache.row).
        poll=True first applies finished writes (owner thread); poll=False is a view without side
        effects."""
        if poll:
            self.poll()
        names_by_key: dict = {}
        for r in self.names.list():
            names_by_key.setdefault((r["namespace"], tuple(r["tokens"])), []).append(r["name"])
        rows = []
        for row in self.cache.rows():
            if is_object_namespace(row["ns"]):
                rows.append(self.objects.row(row))
                continue
            ns, tokens = row.pop("ns"), row.pop("tokens")
            m = self.models.by_namespace(ns)
            rows.append({
                "kind": "prefix", "model": m.name if m else None, "namespace": ns, "tokens": len(tokens),
                "preview": self.models.preview(ns, tokens), "pinned": names_by_key.get((ns, tokens), []), **row,
            })
        return sorted(rows, key=lambda r: -(r["last_used"] or 0))

    def clear(self, ssd: bool = False) -> dict:
        """Drop RAM entries (and SSD files and resume records with ssd=True); named checkpoints stay
        on SSD. Clearing RAM alone first persists what is not on SSD yet, so it only frees memory."""
        if not ssd:
            self.flush(timeout=30)
        cache = self.cache
        ram = len(cache.entries())
        files_before = cache.stats().get("ssd_files", 0)
        kept = cache.clear(ssd=ssd)
        if ssd:
            for record in self.inflight.list():
                self.inflight.finish(record["request"])
        files_removed = files_before - cache.stats().get("ssd_files", 0)
        self.events.emit("cache_cleared", ram_entries=ram - kept, ssd=ssd)
        return {"ram_entries": ram - kept, "kept_not_durable": kept, "ssd_files": files_removed}

    def gc(self, dry_run: bool = False, quarantine: bool = False) -> dict:
        """Remove what nothing can use: stale temp files and resume records without their
        checkpoint; report them (dry_run: only report). Quarantined files are evidence of
        corruption, kept until the user asks (quarantine=True). Names whose state is gone are
        listed, not removed."""
        cache = self.cache
        report = {**cache.gc_files(dry_run, quarantine), "dangling_names": [], "inflight_removed": 0}
        for r in self.names.list():
            ns, tokens = r["namespace"], tuple(r["tokens"])
            if cache.get_exact(tokens, ns) is None and not cache.on_ssd(tokens, ns):
                report["dangling_names"].append(r["name"])
        committed = cache.ssd_keys()
        for record in self.inflight.list():
            if (record.get("namespace"), record.get("boundary_key")) not in committed:
                if not dry_run:
                    self.inflight.finish(record["request"])
                report["inflight_removed"] += 1
        return report

    def verify(self) -> list[dict]:
        """Re-hash every SSD file; bad ones are quarantined and listed."""
        return self.cache.verify()

    def wait_for_writes(self, timeout: float | None = None) -> dict:
        """Wait for writes already queued, from any thread (touches no MLX, queues nothing)."""
        return self.cache.durability.wait_for_writes(timeout)
