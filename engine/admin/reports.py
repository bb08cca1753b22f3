"""What each process holds that the catalogue does not know: its report file.

The catalogue says what is on SSD and who is alive; only a process knows its RAM
tier, its chat sessions, its models and its remote tier. Each engine with an SSD tier
writes `<cache_dir>/processes/<owner>.json` (0600; owner: its catalogue's owner id), on
the owner thread between cells (`ProcessReport.maybe_write`, from the kernel's poll),
when what it says changed and at most every MIN_INTERVAL_S. Not fsynced: it is a view,
not state, and a reader sees the old file or the new one. A clean close removes it; a
killed process's report stays, and says what it held when it died (the panel shows it
as dead), until the next engine to start on the directory removes it. Plain numbers and strings only: nothing here touches an MLX array.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..cache.objects.naming import is_object_namespace
from ..kv.tokens import parting_points, token_key
from ..host import safe_dirs

DIRNAME = "processes"
MIN_INTERVAL_S = 1.0
MAX_ENTRIES = 500  # the newest RAM entries a report lists (it counts them all)
KEEP_DEAD_S = 60.0  # a report without a live process is removed by the next engine to start, past this age
REMOTE_KEYS = ("remote_url", "remote_state", "remote_publish", "remote_auth", "remote_last_error", "remote_hits",
               "remote_misses", "remote_published")


def report_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / DIRNAME


class ProcessReport:
    def __init__(self, engine, clock=time.monotonic):
        self.engine, self.clock = engine, clock
        catalog = engine.cache.catalog
        self.owner = catalog.owner if catalog is not None else None
        self.path = report_dir(engine.cache_dir) / f"{self.owner}.json" if self.owner else None
        self._last_body: str | None = None
        self._last_time = float("-inf")

    def build(self) -> dict:
        """The report, from plain bookkeeping (no SSD index scan, no array): cheap every second."""
        eng, cache = self.engine, self.engine.cache
        entries = sorted(cache.entries(), key=lambda e: -e.last_used_time)
        states = [getattr(e.write_state, "value", e.write_state) for e in entries]
        memory = eng.memory.stats()
        pending = cache.writer.pending() if cache.writer is not None else (0, 0)
        remote = None
        if cache.remote is not None:
            from ..cache.remote.link import remote_stats  # (here: readers of reports need no remote tier modules)

            remote = remote_stats(cache.remote)
        return {
            "owner": self.owner, "pid": os.getpid(),
            "models": [{"name": n, "namespace": m.namespace, "path": str(m.path), "adapter": m.info.get("adapter")}
                       for n, m in ((n, eng.models.get(n)) for n in eng.models.names())],
            "default_model": eng.models.default,
            "sessions": [s.id for s in eng.sessions.list()],
            "ram": {"used_bytes": cache.ram.used_bytes, "budget_bytes": cache.ram.budget_bytes, "entries": len(entries),
                    "high_water_bytes": memory["memory_high_water_bytes"],
                    "working_bytes": memory["memory_working_bytes"]},
            "entries": [self._entry(e, state, at) for e, state, at in zip(entries[:MAX_ENTRIES], states,
                                                                          parting_points([e.tokens for e in entries]))],
            "writes": {"pending": pending[0], "pending_bytes": pending[1], "dirty": states.count("dirty"),
                       "failed": states.count("failed"), "error": cache.durability.write_error},
            "ssd_budget_bytes": eng.config.ssd_budget_bytes, "late_reason": cache.catalog.late,
            "remote": {k[len("remote_"):]: remote.get(k) for k in REMOTE_KEYS} if remote else None,
        }

    def _entry(self, e, state, parts_at: int) -> dict:
        obj = is_object_namespace(e.ns)
        return {"namespace": e.ns, "key": token_key(e.tokens), "tokens": len(e.tokens), "ram_bytes": e.nbytes,
                "write_state": state, "sessions": sorted(e.sessions), "pinned": sorted(e.pinned), "hits": e.hits,
                "last_used": e.last_used_time, "kind": "object" if obj else "prefix",
                "preview": (self.engine.objects.label(e.ns) or "object") if obj
                else self.engine.models.preview(e.ns, e.tokens, parts_at)}

    def maybe_write(self) -> bool:
        """Write the report if it changed and MIN_INTERVAL_S passed; True if written. A
        failure (a full disk, a removed directory) is retried at the next call."""
        if self.path is None or self.clock() - self._last_time < MIN_INTERVAL_S:
            return False
        self._last_time = self.clock()
        report = self.build()
        body = json.dumps(report, sort_keys=True)
        if body == self._last_body:
            return False
        try:
            safe_dirs.make_private_dir(self.path.parent, self.engine.cache_dir)
            safe_dirs.write_json_atomic(self.path, {**report, "time": time.time()}, durable=False, root=self.engine.cache_dir)
        except OSError:
            return False
        if self._last_body is None:
            self._forget_the_dead()
        self._last_body = body
        return True

    def _forget_the_dead(self) -> None:
        """At our first report: those of processes no longer on the directory go (a killed
        kernel's report outlives it until then), unless young (a peer just starting)."""
        live = {p["owner"] for p in self.engine.cache.catalog.processes()}
        try:
            with safe_dirs.Dir(self.path.parent, self.engine.cache_dir) as d:  # (never through a link)
                for owner in set(read_reports(self.engine.cache_dir)) - live - {self.owner}:
                    if time.time() - d.lstat(f"{owner}.json").st_mtime > KEEP_DEAD_S:
                        d.unlink(f"{owner}.json")
        except OSError:
            pass

    def remove(self) -> None:
        if self.path is not None:
            safe_dirs.unlink(self.path, self.engine.cache_dir)


def read_reports(cache_dir: Path, max_bytes: int = 4 << 20) -> dict[str, dict]:
    """owner -> report, for every readable report (a torn, oversized or foreign one is skipped)."""
    out = {}
    try:
        names = os.listdir(report_dir(cache_dir))
    except OSError:
        return out
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = report_dir(cache_dir) / name
        try:
            st = os.stat(path)
            if st.st_size > max_bytes or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
                continue
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(report, dict) and report.get("owner") == name[: -len(".json")]:
            out[report["owner"]] = report
    return out
