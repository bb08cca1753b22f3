"""The SSD tier: checkpoint files under one root, indexed by the shared catalogue.

    root/catalog.db                                  the catalogue (../catalog.py)
    root/<namespace>/<sha256 of token ids>.ckpt      committed checkpoints
    root/<namespace>/.<name>.<pid>.<n>.tmp           writes in progress (ignored)
    root/quarantine/                                 files found bad, kept as evidence

Every process sharing the root sees the same files: its in-memory index is a
copy of the catalogue's rows, brought up to date from the change log before
each lookup (no directory scans on the hot path). At start the files on disk
are reconciled with the catalogue: rows whose file vanished are dropped and
complete files without a row (a lost catalogue, an older build) are indexed
from their headers. Files of a newer format version are left alone.

Every deletion (supersession, the SSD cap, clear, quarantine) is a catalogue
transaction that spares pinned and leased files; the cap counts every
process's bytes. Identity: the caller registers the expected identity of each
namespace; files of other namespaces count against capacity but are not served.
Thread safety: one lock over the in-memory index; any thread may call in. No
MLX here: `read` verifies into buffers the caller allocates (restore.py).
"""

from __future__ import annotations

import os
import re
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ...kv.tokens import token_key
from ...system import make_private_dir, unlink_quietly
from ..catalog import Catalog, FileRow, pid_alive
from . import format as fmt
from .format import CorruptCheckpoint, FileInfo, Header, NewerFormat
from .index import FileIndex, IndexEntry
from .reader import read_tensors

NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
QUARANTINE = "quarantine"
SUFFIX = ".ckpt"
STALE_TEMP_S = 3600.0


class CheckpointUnavailable(Exception):
    """A checkpoint could not be restored; treat it as a cache miss."""


def validate_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace) or namespace == QUARANTINE:
        raise ValueError(f"invalid namespace {namespace!r}: use [A-Za-z0-9_-]{{1,64}}")
    return namespace


def _row(path: Path, h: Header) -> FileRow:
    return FileRow(h.namespace, token_key(h.tokens), str(path), h.tokens, h.file_size, h.raw_bytes,
                   h.min_reusable_offset, h.trimmable, h.version, h.created, time.time(), h.identity)


class CheckpointStore:
    def __init__(self, root, *, ssd_budget_bytes: int | None = None, on_event: Callable[[dict], None] | None = None,
                 on_removed: Callable[[str, tuple], None] | None = None):
        self.root = make_private_dir(root)
        make_private_dir(self.root / QUARANTINE)
        self.ssd_budget_bytes = ssd_budget_bytes
        self.on_event, self.on_removed = on_event, on_removed
        self.index = FileIndex()
        self._lock = self.index.lock
        self._entries = self.index.entries  # (namespace, key) -> IndexEntry
        self._identities: dict[str, dict] = {}
        self._reported: set = set()
        self._stats = {"quarantined": 0, "restores": 0, "restore_bytes": 0, "restore_seconds": 0.0, "evicted": 0,
                       "newer_format_files": 0}
        self.catalog = Catalog(self.root / "catalog.db")
        self.rebuilds = 0  # times the catalogue was found gone or broken and rebuilt while running
        self._reload()
        self._reconcile()

    # --- the in-memory view of the catalogue ---

    def _reload(self) -> None:
        self.index.load(self.catalog.files())

    def sync(self) -> None:
        """Apply what any process committed or deleted since the last call (an indexed query).

        A catalogue that was deleted, replaced or corrupted meanwhile is reopened
        (rebuilt if need be) and reconciled with the files.
        """
        try:
            if self.catalog.replaced():
                raise sqlite3.DatabaseError("the catalogue was deleted or replaced")
            added, removed, reload = self.catalog.changes()
        except sqlite3.DatabaseError:
            self.catalog.reopen()
            self.rebuilds += 1
            self._reload()
            self._reconcile()
            self._emit({"type": "catalog_rebuilt", "path": str(self.catalog.path)})
            return
        with self._lock:
            if reload:
                self._reload()
                return
            for r in added:
                self.index.put(IndexEntry.from_row(r))
            gone = [e for e in (self.index.forget(k) for k in removed) if e is not None]
        for e in gone:
            if self.on_removed is not None:
                self.on_removed(e.namespace, e.tokens)

    def _reconcile(self) -> None:
        """Make the catalogue match the files: drop rows without a (readable, current-format)
        file, index files without a row, quarantine files whose header is bad."""
        on_disk = {}
        for d in sorted(self.root.iterdir()):
            if d.is_dir() and d.name != QUARANTINE and NAMESPACE_RE.fullmatch(d.name):
                self._clean_stale_temps(d)
                on_disk.update({(d.name, n[: -len(SUFFIX)]): d / n for n in os.listdir(d)
                                if n.endswith(SUFFIX) and not n.startswith(".")})
        with self.catalog.transaction() as db:
            for k in set(self._entries) - set(on_disk):
                self.catalog.drop_file(db, *k)
        for k, path in sorted(on_disk.items()):
            try:
                h = fmt.read_header(path)
                if h.namespace != k[0] or token_key(h.tokens) != k[1]:
                    raise CorruptCheckpoint("file name or directory does not match its header")
            except FileNotFoundError:
                continue
            except NewerFormat:  # a newer build's file: not served, not ours to judge or delete
                self._stats["newer_format_files"] += 1
                if k in self._entries:  # no row for it either
                    with self.catalog.transaction() as db:
                        self.catalog.drop_file(db, *k)
                continue
            except (CorruptCheckpoint, OSError) as exc:
                self._quarantine(path, getattr(exc, "reason", None) or repr(exc), k)
                continue
            known = self._entries.get(k)
            if known is None or known.file_bytes != h.file_size:
                with self.catalog.transaction() as db:
                    self.catalog.add_file(db, _row(path, h))
        self.sync()

    def _clean_stale_temps(self, d: Path, dry_run: bool = False) -> list[Path]:
        """Temp files no writer will finish: their process is gone, or they are over an hour old."""
        stale, now = [], time.time()
        for name in os.listdir(d):
            if name.startswith(".") and name.endswith(".tmp"):
                parts = name.split(".")  # "", <key>, "ckpt", <pid>, <n>, "tmp"
                try:
                    dead = len(parts) == 6 and parts[3].isdigit() and not pid_alive(int(parts[3]))
                    if dead or now - os.stat(d / name).st_mtime > STALE_TEMP_S:
                        stale.append(d / name)
                except OSError:
                    pass
        for p in [] if dry_run else stale:
            unlink_quietly(p)
        return stale

    def register_namespace(self, namespace: str, identity: dict) -> None:
        """Declare the identity files of `namespace` must carry; quarantine those that differ."""
        validate_namespace(namespace)
        self.sync()
        with self._lock:
            self._identities[namespace] = dict(identity)
            bad = [e for k, e in self._entries.items() if k[0] == namespace and e.identity != identity]
        for e in bad:
            self._quarantine(e.path, "identity mismatch", (e.namespace, e.key))

    def _quarantine(self, path: Path, reason: str, k: tuple | None = None) -> None:
        """Move a bad file aside (in a catalogue transaction); a failed move is reported, the file kept."""
        dest = self.root / QUARANTINE / f"{path.parent.name}.{path.name}.{time.time_ns()}"
        with self.catalog.transaction() as db:
            row = self.catalog.file(*k) if k else None
            if row is not None and row.path == str(path):
                self.catalog.drop_file(db, *k)
            try:
                os.replace(path, dest)
            except FileNotFoundError:
                return  # another process moved or removed it first
            except OSError as exc:
                self._emit({"type": "quarantine_failed", "path": str(path), "reason": reason, "error": str(exc)})
                return
        self._stats["quarantined"] += 1
        if str(path) not in self._reported:
            self._reported.add(str(path))
            self._emit({"type": "quarantine", "path": str(path), "reason": reason})
        self.sync()

    def _drop_vanished(self, k: tuple, path: Path) -> None:
        """A catalogued file that is gone (removed behind the catalogue's back): forget it."""
        with self.catalog.transaction() as db:
            row = self.catalog.file(*k)
            if row is not None and row.path == str(path) and not os.path.exists(path):
                self.catalog.drop_file(db, *k)
        self.sync()

    def _emit(self, event: dict) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                pass  # an observer must not break the store

    # --- lookup ---

    def contains(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether a committed file holds exactly `tokens`."""
        self.sync()
        with self._lock:
            return (namespace, token_key(tokens)) in self._entries

    def find(self, prompt_tokens: Sequence[int], namespace: str, *, max_len: int | None = None,
             min_len: int = 1) -> IndexEntry | None:
        """Longest usable cached prefix of `prompt_tokens` (at most len-1 tokens, at
        least `min_len` to be worth a read).

        Returns a copy of the index entry with `match_len` set, or None. No file I/O.
        """
        validate_namespace(namespace)
        self.sync()
        if namespace not in self._identities:
            return None
        cap = len(prompt_tokens) - 1 if max_len is None else min(len(prompt_tokens) - 1, max_len)
        return self.index.find(prompt_tokens, namespace, cap, min_len)

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether a committed file can serve exactly `tokens` (exact, or trimmable and longer)."""
        return self.contains(tokens, namespace) or self.index.covers(tokens, namespace)

    def entries(self) -> list[IndexEntry]:
        self.sync()
        return self.index.snapshot()

    # --- restore ---

    def read(self, entry: IndexEntry, allocate: Callable, build: Callable[[Header], Any]):
        """Read and verify `entry`'s file through one descriptor into buffers from
        `allocate(name, dtype, shape)`, then return `build(header)` (see restore.py).

        Any problem is CheckpointUnavailable (a miss). A bad file is quarantined,
        unless the path now holds another file (a concurrent replace is not corruption).
        """
        t0 = time.perf_counter()
        path, k = entry.path, (entry.namespace, entry.key)
        want = self._identities.get(entry.namespace)
        if want is None:  # nothing to check against: a miss, not a bad file
            raise CheckpointUnavailable(f"namespace {entry.namespace} is not registered")
        with self.catalog.lease(*k):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                self._drop_vanished(k, path)
                raise CheckpointUnavailable(f"{path}: file vanished") from None
            try:
                h = fmt.read_header(fd)
                if h.tokens != tuple(entry.tokens) or h.namespace != entry.namespace:
                    raise CorruptCheckpoint("file no longer holds the indexed checkpoint")
                if h.identity != want:
                    raise CorruptCheckpoint("identity mismatch")
                read_tensors(fd, h, allocate)
                result = build(h)
            except NewerFormat as exc:
                raise CheckpointUnavailable(f"{path}: {exc}") from None
            except (CorruptCheckpoint, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
                if _same_file(fd, path):
                    self._quarantine(path, reason, k)
                raise CheckpointUnavailable(f"{path}: {reason}") from None
            finally:
                os.close(fd)
        self.catalog.touch(*k)
        with self._lock:
            e = self._entries.get(k)
            if e is not None:
                e.last_use = time.time()
            self._stats["restores"] += 1
            self._stats["restore_bytes"] += h.raw_bytes
            self._stats["restore_seconds"] += time.perf_counter() - t0
        return result

    # --- commits and deletions (catalogue transactions) ---

    def prepare_path(self, namespace: str, tokens: Sequence[int]) -> Path:
        """Final path for a checkpoint of `tokens`; creates the namespace dir."""
        return make_private_dir(self.root / validate_namespace(namespace)) / (token_key(tokens) + SUFFIX)

    def commit(self, tmp: Path, info: FileInfo) -> None:
        """Rename a finished temp file into place and record it, in one transaction (writer thread)."""
        h = info.header
        with self.catalog.transaction() as db:
            try:
                fmt.read_header(info.path)
            except NewerFormat:  # a newer build's file under this name: leave it alone
                raise FileExistsError(f"{info.path} holds a newer format's checkpoint; not replaced") from None
            except (OSError, CorruptCheckpoint):
                pass
            os.replace(tmp, info.path)
            self.catalog.add_file(db, _row(Path(info.path), h))

    def publish(self, info: FileInfo) -> IndexEntry:
        """After `commit`: supersede older files this one serves, then apply the SSD cap."""
        h = info.header
        self.sync()
        k = (h.namespace, token_key(h.tokens))
        with self.catalog.transaction() as db:
            if h.trimmable:
                with self._lock:
                    older = [e for e in self._entries.values() if e.namespace == h.namespace and len(e) < len(h.tokens)
                             and len(e) >= h.min_reusable_offset and h.tokens[: len(e)] == e.tokens]
                for e in older:
                    self._delete(db, e.namespace, e.key, str(e.path), e.file_bytes, "superseded")
            self._enforce_budget(db, keep=k)
        self.sync()
        with self._lock:
            e = self._entries.get(k)
            return replace(e, _arr=None) if e is not None else IndexEntry.from_row(_row(Path(info.path), h))

    def _delete(self, db, ns: str, key: str, path: str, nbytes: int, reason: str) -> bool:
        if not self.catalog.deletable(db, ns, key):
            return False
        self.catalog.drop_file(db, ns, key)
        unlink_quietly(path)
        self._stats["evicted"] += 1
        self._emit({"type": "evict", "path": path, "reason": reason, "nbytes": nbytes})
        return True

    def _enforce_budget(self, db, keep: tuple | None = None) -> None:
        if self.ssd_budget_bytes is None:
            return
        total = self.catalog.total_bytes(db)  # every process's files
        for ns, key, path, nbytes in self.catalog.lru(db):
            if total <= self.ssd_budget_bytes:
                break
            if (ns, key) != keep and self._delete(db, ns, key, path, nbytes, "capacity"):
                total -= nbytes

    def verify_all(self) -> list[tuple]:
        """Re-read and re-hash every indexed file; quarantine the bad ones."""
        bad = []
        for e in self.entries():
            try:
                h = fmt.read_header(e.path)
                if h.identity != self._identities.get(h.namespace, h.identity):
                    raise CorruptCheckpoint("identity mismatch")
                read_tensors(e.path, h, lambda n, dt, sh: np.empty(sh, fmt.host_dtype(dt)))
            except (FileNotFoundError, NewerFormat):
                continue
            except (CorruptCheckpoint, OSError) as exc:
                reason = getattr(exc, "reason", None) or repr(exc)
                self._quarantine(e.path, reason, (e.namespace, e.key))
                bad.append((e.path, reason))
        return bad

    def clear(self) -> None:
        """Delete every catalogued checkpoint that no name pins and no reader leases."""
        with self.catalog.transaction() as db:
            for ns, key, path, nbytes in self.catalog.lru(db):
                self._delete(db, ns, key, path, nbytes, "cleared")
        self.sync()

    def gc(self, dry_run: bool = False) -> dict:
        """Quarantined files and temp files older than an hour (crashed writers): what goes, listed."""
        quarantined = sorted((self.root / QUARANTINE).iterdir())
        temps = [p for d in self.root.iterdir() if d.is_dir() and d.name != QUARANTINE
                 for p in self._clean_stale_temps(d, dry_run=True)]
        if not dry_run:
            for p in quarantined + temps:
                unlink_quietly(p)
        return {"quarantine_removed": [str(p) for p in quarantined], "temp_removed": [str(p) for p in temps]}

    def stats(self) -> dict:
        self.sync()
        with self._lock:
            s = dict(self._stats)
            s["files"] = len(self._entries)
            s["bytes"] = sum(e.file_bytes for e in self._entries.values())
            s["kv_bytes"] = sum(e.raw_bytes for e in self._entries.values())
            s["budget_bytes"] = self.ssd_budget_bytes
        processes = self.catalog.processes()
        s["processes"] = len(processes)
        s["processes_pending_writes"] = sum(p["pending_writes"] for p in processes)
        return s

    def close(self) -> None:
        self.catalog.close()


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
