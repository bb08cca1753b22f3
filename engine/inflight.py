"""In-flight generation records: how a killed generation resumes exactly.

Every N decoded tokens a generation queues its cache at the boundary
"prompt + emitted[:-1]" with the pending token emitted[-1]; once that file
commits, the writer thread records the request's sampler state (seed, step,
emitted tokens) here. An identical request (same namespace, prompt tokens and
sampling settings) finds the record, restores the boundary and continues at
step len(emitted): with (seed, step) sampling that is exactly the
uninterrupted output. Completion removes the record; an interrupt keeps it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Sequence

from .system import make_private_dir, write_json_atomic


def request_id(namespace: str, tokens: Sequence[int], params: dict) -> str:
    blob = json.dumps([namespace, [int(t) for t in tokens], params], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class InflightRecords:
    def __init__(self, directory: Path):
        self.dir = make_private_dir(directory)
        self._lock = threading.Lock()
        self._finished: set[str] = set()  # requests whose late writes must not re-create a record

    def _path(self, rid: str) -> Path:
        if not all(c in "0123456789abcdef" for c in rid) or len(rid) != 32:
            raise ValueError(f"bad request id {rid!r}")
        return self.dir / f"{rid}.json"

    def load(self, rid: str) -> dict | None:
        try:
            record = json.loads(self._path(rid).read_text())
        except (OSError, ValueError):
            return None
        emitted = record.get("emitted")
        if record.get("request") != rid or not isinstance(emitted, list) or not emitted:
            return None
        if not all(isinstance(t, int) for t in emitted):
            return None
        return record

    def write(self, rid: str, record: dict) -> None:
        """Atomically replace the record (writer thread), unless the request already finished."""
        path = self._path(rid)
        with self._lock:
            if rid in self._finished:
                return
            current = self.load(rid)
            if current is not None and len(current["emitted"]) >= len(record["emitted"]):
                return  # never step back to an older boundary
            write_json_atomic(path, {**record, "request": rid, "time": time.time()})

    def start(self, rid: str) -> None:
        with self._lock:
            self._finished.discard(rid)

    def finish(self, rid: str) -> None:
        with self._lock:
            self._finished.add(rid)
            try:
                self._path(rid).unlink()
            except FileNotFoundError:
                pass

    def list(self) -> list[dict]:
        out = []
        for p in self.dir.glob("*.json"):
            record = self.load(p.stem)
            if record is not None:
                out.append(record)
        return out
