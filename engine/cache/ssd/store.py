"""The SSD tier: checkpoint files under one root, indexed by the shared catalogue.

    root/catalog.db                                  the catalogue (../catalog.py)
    root/<namespace>/<key of token ids>.ckpt         committed checkpoints (manifests)
    root/<namespace>/.<name>.<pid>.<n>.tmp           writes in progress (ignored)
    root/blocks/<2 hex>/<BLAKE3>.blk                 KV token spans, shared (blocks.py)
    root/quarantine/                                 files found bad, kept as evidence

Every process sharing the root sees the same files: its in-memory index is a
copy of the catalogue's rows, brought up to date from the change log before
each lookup (no directory scans on the hot path). At start the files on disk
are reconciled with the catalogue: rows whose file vanished are dropped and
complete files without a row (a lost catalogue, an older build) are indexed
from their headers. Files of a newer format version are left alone.

Every deletion (supersession, the SSD cap, clear, quarantine) is a catalogue
transaction that spares pinned and leased files and frees the blocks no
other manifest references; the cap counts every process's unique bytes. Identity: the caller registers the expected identity of each
namespace; files of other namespaces count against capacity but are not served.
Thread safety: one lock over the in-memory index; any thread may call in. No
MLX here: `read` verifies into buffers the caller allocates (restore.py).
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence


from ...kv.tokens import token_key
from ...system import make_private_dir, unlink_quietly
from ..catalog import Catalog, FileRow
from . import format as fmt
from .format import CorruptCheckpoint, FileInfo, Header, NewerFormat
from .index import FileIndex, IndexEntry
from .pending import CheckpointUnavailable, PendingRead

__all__ = ["CheckpointStore", "CheckpointUnavailable", "PendingRead", "validate_namespace"]
from .upkeep import BLOCKS, NAMESPACE_RE, QUARANTINE, SUFFIX, Upkeep



def validate_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace) or namespace in (QUARANTINE, BLOCKS):
        raise ValueError(f"invalid namespace {namespace!r}: use [A-Za-z0-9_-]{{1,64}}")
    return namespace


def _row(path: Path, h: Header) -> FileRow:
    """The catalogue row of a file (for format 2, with its block references)."""
    return FileRow(h.namespace, token_key(h.tokens), str(path), h.tokens, h.file_size, h.raw_bytes,
                   h.min_reusable_offset, h.trimmable, h.version, h.created, time.time(), h.identity,
                   h.block_bytes, tuple(b.name for b in h.blocks))


class CheckpointStore(Upkeep):
    def __init__(self, root, *, ssd_budget_bytes: int | None = None, on_event: Callable[[dict], None] | None = None,
                 on_removed: Callable[[str, tuple], None] | None = None):
        self.root = make_private_dir(root)
        make_private_dir(self.root / QUARANTINE)
        self.blocks_root = make_private_dir(self.root / BLOCKS)
        self.ssd_budget_bytes = ssd_budget_bytes
        self.on_event, self.on_removed = on_event, on_removed
        self.index = FileIndex()
        self._lock = self.index.lock
        self._entries = self.index.entries  # (namespace, key) -> IndexEntry
        self._identities: dict[str, dict] = {}
        self._reported: set = set()
        self._stats = {"quarantined": 0, "restores": 0, "restore_bytes": 0, "restore_seconds": 0.0, "evicted": 0,
                       "newer_format_files": 0, "bytes_written": 0, "bytes_deduplicated": 0, "blocks_freed": 0}
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

    _row = staticmethod(_row)

    def register_namespace(self, namespace: str, identity: dict, *, check: bool = True) -> None:
        """Declare the identity files of `namespace` must carry; quarantine those that differ
        (check=False: the caller has checked its one file, as the object cache does)."""
        validate_namespace(namespace)
        if not check:
            with self._lock:
                self._identities[namespace] = dict(identity)
            return
        self.sync()
        with self._lock:
            self._identities[namespace] = dict(identity)
            bad = [e for k, e in self._entries.items() if k[0] == namespace and e.identity != identity]
        for e in bad:
            self._quarantine(e.path, "identity mismatch", (e.namespace, e.key))

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

    def file_info(self, namespace: str, tokens: Sequence[int]) -> FileInfo | None:
        """The committed checkpoint of exactly `tokens`, read from its header (None if there is none)."""
        with self._lock:
            e = self._entries.get((namespace, token_key(tokens)))
        try:
            h = fmt.read_header(e.path) if e is not None else None
        except (OSError, CorruptCheckpoint, NewerFormat):
            return None
        return FileInfo(e.path, h, h.file_size, h.raw_bytes, 0.0) if h is not None else None

    def is_pinned(self, namespace: str, tokens: Sequence[int]) -> bool:
        """Whether a name pins the checkpoint of exactly `tokens`."""
        return (namespace, token_key(tokens)) in set(self.catalog.pins().values())

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether a committed file can serve exactly `tokens` (exact, or trimmable and longer)."""
        return self.contains(tokens, namespace) or self.index.covers(tokens, namespace)

    def entries(self) -> list[IndexEntry]:
        self.sync()
        return self.index.snapshot()

    # --- restore ---

    def open_read(self, entry: IndexEntry, *, touch: bool = True) -> PendingRead:
        """Start reading `entry` (owner thread): the catalogue lease, the descriptor, the
        header and its identity checks. See pending.py for the rest of the read."""
        return PendingRead(self, entry, touch=touch)

    def read(self, entry: IndexEntry, allocate: Callable, build: Callable[[Header], Any]):
        """Read and verify `entry`'s file through one descriptor into buffers from
        `allocate(name, dtype, shape)`, then return `build(header)` (see restore.py):
        open_read, allocate, fill and finish on the calling thread.

        Any problem is CheckpointUnavailable (a miss). A bad file is quarantined,
        unless the path now holds another file (a concurrent replace is not corruption).
        """
        pending = self.open_read(entry)
        pending.allocate(allocate)
        pending.fill()
        return pending.finish(build)

    def count_restore(self, read: PendingRead, *, touch: bool = True) -> None:
        """A finished read: restore statistics and, unless it was speculative, the file's last use."""
        if touch:
            self.catalog.touch(*read.key)
        with self._lock:
            e = self._entries.get(read.key)
            if e is not None and touch:
                e.last_use = time.time()
            self._stats["restores"] += 1
            self._stats["restore_bytes"] += read.header.raw_bytes + read.header.block_bytes
            self._stats["restore_seconds"] += read.seconds

    # --- commits and deletions (catalogue transactions) ---

    def prepare_path(self, namespace: str, tokens: Sequence[int]) -> Path:
        """Final path for a checkpoint of `tokens`; creates the namespace dir."""
        return make_private_dir(self.root / validate_namespace(namespace)) / (token_key(tokens) + SUFFIX)

    def commit(self, tmp: Path, info: FileInfo, write_id: int | None = None, new_blocks: dict | None = None) -> None:
        """Rename a finished temp file into place and record it with its block references,
        in one transaction that also ends the write's block claims (writer thread)."""
        h = info.header
        with self.catalog.transaction() as db:
            try:
                fmt.read_header(info.path)
            except NewerFormat:  # a newer build's file under this name: leave it alone
                raise FileExistsError(f"{info.path} holds a newer format's checkpoint; not replaced") from None
            except (OSError, CorruptCheckpoint):
                pass
            old = self.catalog.file(h.namespace, token_key(h.tokens))
            if new_blocks:
                self.catalog.add_blocks(new_blocks, db)
            os.replace(tmp, info.path)
            freed = self.catalog.add_file(db, _row(Path(info.path), h))
            if old is not None and old.path != str(info.path):  # a format 1 file of the same tokens
                unlink_quietly(old.path)
            if write_id is not None:
                freed += self.catalog.release(db, write_id)
            self._unlink_blocks(self.catalog.free_blocks(db, freed))

    def release(self, write_id: int) -> None:
        """End a failed or skipped write's block claims; free what nothing references."""
        with self.catalog.transaction() as db:
            self._unlink_blocks(self.catalog.free_blocks(db, self.catalog.release(db, write_id)))

    def count_write(self, written: int, deduplicated: int) -> None:
        with self._lock:
            self._stats["bytes_written"] += written
            self._stats["bytes_deduplicated"] += deduplicated

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
        self._drop(db, ns, key)
        unlink_quietly(path)
        self._stats["evicted"] += 1
        self._emit({"type": "evict", "path": path, "reason": reason, "nbytes": nbytes})
        return True

    def _enforce_budget(self, db, keep: tuple | None = None) -> None:
        if self.ssd_budget_bytes is None:
            return
        # every process's unique bytes: deleting a manifest frees only blocks nobody else uses
        for ns, key, path, nbytes in self.catalog.lru(db):
            if self.catalog.total_bytes(db) <= self.ssd_budget_bytes:
                break
            if (ns, key) != keep:
                self._delete(db, ns, key, path, nbytes, "capacity")

    def remove(self, keys, reason: str = "removed") -> int:
        """Delete the files of these (namespace, tokens) that no name pins and no reader
        leases, in one transaction; how many went."""
        self.sync()
        with self._lock:
            found = [e for e in (self._entries.get((ns, token_key(t))) for ns, t in keys) if e is not None]
        with self.catalog.transaction() as db:
            removed = sum(self._delete(db, e.namespace, e.key, str(e.path), e.file_bytes, reason) for e in found)
        self.sync()
        return removed

    def clear(self) -> None:
        """Delete every catalogued checkpoint that no name pins and no reader leases."""
        with self.catalog.transaction() as db:
            for ns, key, path, nbytes in self.catalog.lru(db):
                self._delete(db, ns, key, path, nbytes, "cleared")
        self.sync()

    def stats(self) -> dict:
        self.sync()
        with self._lock:
            s = dict(self._stats)
            s["files"] = len(self._entries)
            s["kv_bytes"] = sum(e.raw_bytes for e in self._entries.values())
            s["budget_bytes"] = self.ssd_budget_bytes
        s["blocks"], s["block_bytes"] = self.catalog.block_totals()
        with self._lock:  # unique bytes: each manifest or file once, each block once
            s["bytes"] = sum(e.file_bytes for e in self._entries.values()) + s["block_bytes"]
        processes = self.catalog.processes()
        s["processes"] = len(processes)
        s["processes_pending_writes"] = sum(p["pending_writes"] for p in processes)
        return s

    def close(self) -> None:
        self.catalog.close()

