"""What `%cache` does over the whole cache (`eng.admin`): list every entry (prefixes and objects,
with their names and previews), say why a prompt missed, clear RAM or SSD, collect what nothing can
use, verify the SSD files, wait for queued writes."""

from __future__ import annotations

from typing import Callable

from ..cache.objects.cache import ObjectCache, is_object_namespace
from ..cache.tiered import TieredPromptCache
from ..cache.why import Explainer, Why
from ..chat.prompts import encode_prompt
from ..events import EventBus
from ..generate.resume import InflightRecords
from ..kv.tokens import parting_points
from ..models.registry import ModelRegistry
from ..named.checkpoints import NamedCheckpoints


class CacheAdmin:
    def __init__(self, *, cache: TieredPromptCache, names: NamedCheckpoints, models: ModelRegistry,
                 objects: ObjectCache, inflight: InflightRecords, events: EventBus,
                 poll: Callable[[], None], flush: Callable[..., dict]):
        """poll and flush: the engine's (apply finished background work; wait for durable writes)."""
        self.cache, self.names, self.models, self.objects = cache, names, models, objects
        self.inflight, self.events, self.poll, self.flush = inflight, events, poll, flush
        self.explainer = Explainer(cache.prefixes, cache.departures, cache.identities.get, self._decode,
                                   lambda ns: getattr(models.by_namespace(ns), "name", None))

    def why(self, prompt: str | None = None, *, model: str | None = None, system: str | None = None,
            raw: bool = False) -> Why | None:
        """Why the last generation reused what it did from the cache (None before the first), or,
        given a prompt, what a lookup of it would reuse now and why not more (cache/why.py)."""
        if prompt is None:
            return self.explainer.last
        self.poll()
        m = self.models.get(model)
        return self.explainer.explain(encode_prompt(m.tokenizer, prompt, system=system, raw=raw), m.namespace)

    def _decode(self, ns: str, tokens: list) -> str | None:
        m = self.models.by_namespace(ns)
        return m.tokenizer.decode(tokens) if m is not None else None

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
        rows, cached, parts = [], self.cache.rows(), {}
        for group in _by_namespace(cached).values():  # where each entry parts from the one most like it
            parts.update(zip(map(id, group), parting_points([r["tokens"] for r in group])))
        for row in cached:
            if is_object_namespace(row["ns"]):
                rows.append(self.objects.row(row))
                continue
            at = parts[id(row)]
            ns, tokens = row.pop("ns"), row.pop("tokens")
            m = self.models.by_namespace(ns)
            rows.append({
                "kind": "prefix", "model": m.name if m else None, "namespace": ns, "tokens": len(tokens),
                "preview": self.models.preview(ns, tokens, at), "pinned": names_by_key.get((ns, tokens), []), **row,
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


def _by_namespace(rows: list[dict]) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r["ns"], []).append(r)
    return out
