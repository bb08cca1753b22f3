"""What the JupyterLab panel may change on a cache directory: pin, unpin, delete.

Every change goes through the engine's own code: a pin is a named checkpoint (its
record, then the catalogue pin, as `%checkpoint save` does), an unpin removes one (as
`%checkpoint rm`), a delete is `CheckpointStore.remove`, the transaction that spares
every pinned and leased file. On top, the rules that protect other kernels:

- a name saved by a live process, or held in a live process's RAM, is that process's:
  the panel does not remove it (the message names the process and the magic to use);
- a checkpoint a live process holds in RAM is not deleted (it would write it again);
- a pinned or leased one is refused by the store itself, and the answer says why.

The store is opened on the first change (it registers this process on the directory,
like any engine, and reconciles it once) and closed with `close()`. Answers are
`{"ok": bool, "message": str}`; a bad name or key is a ValueError with one line.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from ..cache.catalog.database import CatalogBusy
from ..cache.ssd.store import CheckpointStore, validate_namespace
from ..kv.tokens import token_key
from ..named.checkpoints import CheckpointNameError, NamedCheckpoints, check_name
from .reports import read_reports

_KEY = re.compile(r"[0-9a-f]{64}")


def _answer(ok: bool, message: str, **more) -> dict:
    return {"ok": ok, "message": message, **more}


class DirectoryActions:
    def __init__(self, cache_dir):
        self.cache_dir = Path(cache_dir).expanduser()
        self._store: CheckpointStore | None = None
        self._lock = threading.Lock()  # one change at a time

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            if not (self.cache_dir / "checkpoints" / "catalog.db").exists():
                raise ValueError(f"{self.cache_dir} has no SSD tier yet: nothing to change")
            self._store = CheckpointStore(self.cache_dir / "checkpoints")
        return self._store

    @property
    def names(self) -> NamedCheckpoints:
        return NamedCheckpoints(self.cache_dir / "names")

    def _live(self) -> dict:
        """owner -> pid of the live processes on the directory (but this one)."""
        me = self.store.catalog.owner
        return {p["owner"]: p["pid"] for p in self.store.catalog.processes() if p["owner"] != me}

    def _holders(self, live: dict, key: tuple, name: str | None = None) -> list[int]:
        """Pids of live processes holding `key` in RAM (with `name`: pinned by that name)."""
        pids = set()
        for owner, report in read_reports(self.cache_dir).items():
            if owner in live:
                for e in report.get("entries") or ():
                    if (e.get("namespace"), e.get("key")) == key and (name is None or name in (e.get("pinned") or ())):
                        pids.add(live[owner])
        return sorted(pids)

    @staticmethod
    def _checked(namespace: str, key: str) -> tuple:
        validate_namespace(namespace)
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"invalid checkpoint key {key!r}: 64 hex digits")
        return namespace, key

    def pin(self, namespace: str, key: str, name: str) -> dict:
        k, name = self._checked(namespace, key), check_name(name)
        with self._lock:
            catalog = self.store.catalog
            row = catalog.file(*k)
            if row is None:
                return _answer(False, "this checkpoint is no longer on SSD")
            try:
                self.names.get(name)
                return _answer(False, f"the name {name!r} is taken: choose another")
            except CheckpointNameError:
                pass
            me = catalog.identity
            self.names.save(name, {"namespace": row.namespace, "model": None, "tokens": list(row.tokens),
                                   "kv_bytes": row.kv_bytes, "durable": True, "session": None, "preview": None,
                                   "saved_by": {"owner": catalog.owner, "pid": me.pid, "host": me.host, "panel": True}})
            try:
                catalog.set_pin(name, *k)  # the record first: a process starting meanwhile pins what records name
                if catalog.file(*k) is None:  # deleted before the pin: nothing to keep
                    catalog.set_pin(name, None, None)
                    self.names.remove(name)
                    return _answer(False, "this checkpoint was deleted meanwhile")
            except CatalogBusy as e:
                self.names.remove(name)
                return _answer(False, f"{e}: try again")
        return _answer(True, f"pinned as {name!r} ({len(row.tokens)} tokens): no cap or clear deletes it; "
                             f"%checkpoint restore {name} brings it back in any kernel with its model")

    def unpin(self, name: str) -> dict:
        check_name(name)
        with self._lock:
            record = self.names.get(name)
            live = self._live()
            saved_by = record.get("saved_by") or {}
            by = None if saved_by.get("panel") else saved_by.get("owner")
            k = (record["namespace"], token_key(record["tokens"]))
            holders = sorted(set(self._holders(live, k, name)) | ({live[by]} if by in live else set()))
            if holders:
                return _answer(False, f"{name!r} belongs to the live kernel pid {holders[0]}: remove it there with "
                                      f"%checkpoint rm {name}")
            try:
                self.store.catalog.set_pin(name, None, None)
            except CatalogBusy as e:
                return _answer(False, f"{e}: try again")
            self.names.remove(name)
        return _answer(True, f"unpinned {name!r}: the checkpoint stays until a cap or a clear removes it")

    def delete(self, namespace: str, key: str) -> dict:
        k = self._checked(namespace, key)
        with self._lock:
            catalog = self.store.catalog
            row = catalog.file(*k)
            if row is None:
                return _answer(True, "already gone")
            pins = sorted(n for n, where in catalog.pins().items() if where == k)
            if pins:
                return _answer(False, f"pinned by {', '.join(map(repr, pins))}: unpin it first")
            holders = self._holders(self._live(), k)
            if holders:
                return _answer(False, f"the live kernel pid {holders[0]} holds it in RAM and would write it again: "
                                      "%cache clear there frees its RAM (SSD kept), then delete")
            try:
                removed = self.store.remove([k], reason="deleted from the panel", label="panel")
            except CatalogBusy as e:
                return _answer(False, f"{e}: try again")
        if removed:
            return _answer(True, f"deleted ({len(row.tokens)} tokens, {row.file_bytes + row.block_bytes} bytes)")
        return _answer(False, "a kernel is reading it right now (leased): try again in a moment"
                       if catalog.file(*k) is not None else "already gone")

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
