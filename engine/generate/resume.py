"""In-flight generation records: how a killed generation resumes exactly.

Every N decoded tokens a generation queues its cache at the boundary
"prompt + emitted[:-1]" with the pending token emitted[-1]; once that file
commits, the writer thread records the request's sampler state (seed, step,
emitted tokens) in the catalogue. An identical request (same namespace,
prompt tokens and sampling settings), in this process or another, finds the
record, restores the boundary and continues at step len(emitted): with
(seed, step) sampling that is exactly the uninterrupted output. Completion
removes the record; an interrupt keeps it. Without an SSD tier there is
nothing to resume from, and no records.
"""

from __future__ import annotations

import blake3
import json
import threading
from pathlib import Path
from typing import Sequence

from ..cache.catalog.tables import Catalog
from ..cache.catalog.database import CatalogBusy
from ..host import safe_dirs


def request_id(namespace: str, tokens: Sequence[int], params: dict) -> str:
    blob = json.dumps([namespace, [int(t) for t in tokens], params], sort_keys=True)
    return blake3.blake3(blob.encode()).hexdigest()[:32]


class InflightRecords:
    def __init__(self, catalog: Catalog | None, legacy_dir: Path | None = None):
        self.catalog = catalog
        self._lock = threading.Lock()
        self._finished: set[str] = set()  # requests whose late writes must not re-create a record
        if catalog is not None and legacy_dir is not None:
            self._migrate(Path(legacy_dir))

    def _migrate(self, legacy_dir: Path) -> None:
        """Records of builds that kept them as JSON files move into the catalogue (the directory
        opened from its parent, never through a link: host/safe_dirs.py)."""
        try:
            d = safe_dirs.Dir(legacy_dir, legacy_dir.parent)
        except OSError:  # none (the usual case), or a link (reported)
            return
        with d:
            for name in sorted(n for n in d.names() if n.endswith(".json") and not n.startswith(".")):
                try:
                    record = json.loads((legacy_dir / name).read_text())
                    self.catalog.inflight_put(record["request"], record)
                except CatalogBusy:
                    return  # the rest next time
                except (OSError, ValueError, KeyError, TypeError):
                    pass
                d.unlink(name)

    def load(self, rid: str) -> dict | None:
        record = self.catalog.inflight_get(rid) if self.catalog is not None else None
        if record is None:
            return None
        emitted = record.get("emitted")
        if record.get("request") != rid or not isinstance(emitted, list) or not emitted:
            return None
        if not all(isinstance(t, int) for t in emitted):
            return None
        return record

    def write(self, rid: str, record: dict) -> None:
        """Replace the record (writer thread), unless the request already finished. No lock is
        held across the catalogue (whose write lock this thread may wait for): a finish that
        comes meanwhile is seen after the write, and the record goes again."""
        with self._lock:
            if rid in self._finished or self.catalog is None:
                return
        current = self.load(rid)
        if current is not None and len(current["emitted"]) >= len(record["emitted"]):
            return  # never step back to an older boundary
        self.catalog.inflight_put(rid, {**record, "request": rid})
        self._delete_if_finished(rid)

    def start(self, rid: str) -> None:
        with self._lock:
            self._finished.discard(rid)

    def finish(self, rid: str) -> None:
        with self._lock:
            self._finished.add(rid)
        if self.catalog is not None:
            try:
                self._delete_if_finished(rid)
            except CatalogBusy:  # the cell goes on; the record goes once the catalogue is free
                self.catalog.later(lambda: self._delete_if_finished(rid))

    def _delete_if_finished(self, rid: str) -> None:
        with self._lock:
            finished = rid in self._finished  # (not when the same request started again meanwhile)
        if finished:
            self.catalog.inflight_delete(rid)

    def list(self) -> list[dict]:
        records = self.catalog.inflight_all() if self.catalog is not None else []
        return [r for r in records if self.load(r.get("request", "")) is not None]
