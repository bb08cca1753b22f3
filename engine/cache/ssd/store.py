"""The SSD tier: checkpoint files under one root (layout.py), indexed by the shared catalogue.

Every process sharing the root sees the same files: its in-memory index is a
copy of the catalogue's rows, brought up to date from the change log before
each lookup (no directory scans on the hot path). At start the files on disk
are reconciled with the catalogue (upkeep.py).

A commit checks, inside its transaction, that the write still claims every
block it references and that each is recorded; then it renames the new
manifest (a name no one else uses) last, so a failed COMMIT leaves the old
version indexed and the new file removed. Every deletion (supersession, the
SSD cap, clear, quarantine) is a short transaction that spares pinned and
leased files and frees only blocks no file references and no live process
claims; unlinks follow the COMMIT (removal.py). The cap counts every
process's unique bytes (totals kept by the catalogue). A busy catalogue is
never a failure here: lookups go on from the index, reads go unleased, and
`late` says why the SSD tier lags. A directory on a network filesystem is
refused (SQLite's WAL needs a local disk).

Identity: the caller registers the expected identity of each namespace;
files of other namespaces count against capacity but are not served. Any
thread may call in. No MLX here: `read` verifies into buffers the caller
allocates (restore.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from ...kv.tokens import token_key
from ...host import safe_dirs
from ...host.safe_dirs import make_private_dir
from ...host.system import fsync_dir, unsupported_filesystem
from ..catalog.tables import Catalog, FileRow
from ..catalog.database import CatalogBusy, CatalogCorrupt
from ..faults import fault
from . import format as fmt
from .capacity import enforce_budget, evict_rest
from .format import CorruptCheckpoint, FileInfo, Header, NewerFormat
from .index import FileIndex, IndexEntry
from .pending_read import CheckpointUnavailable, PendingRead
from .removal import AfterCommit, changing
from .leases import Reads
from .layout import BLOCKS, HEARTBEATS, NAMESPACE_RE, QUARANTINE, SUFFIX
from .upkeep import Upkeep
from ...errors import LinkedDirectory, UnsupportedFilesystem  # noqa: F401 (raised here; defined in errors.py)

__all__ = ["CheckpointStore", "CheckpointUnavailable", "LostClaims", "PendingRead", "validate_namespace"]


class LostClaims(Exception):
    """A write's blocks are no longer all claimed and recorded (another process took the
    writer for dead and freed them): nothing was committed; the write is retried."""



def validate_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace) or namespace in (QUARANTINE, BLOCKS):
        raise ValueError(f"invalid namespace {namespace!r}: use [A-Za-z0-9_-]{{1,64}}")
    return namespace


def _row(path: Path, h: Header) -> FileRow:
    """The catalogue row of a file (for format 2, with its block references)."""
    return FileRow(h.namespace, token_key(h.tokens), str(path), h.tokens, h.file_size, h.raw_bytes,
                   h.min_reusable_offset, h.trimmable, h.version, h.created, time.time(), h.identity,
                   h.block_bytes, tuple(b.name for b in h.blocks))


class CheckpointStore(Reads, Upkeep):
    def __init__(self, root, *, ssd_budget_bytes: int | None = None, on_event: Callable[[dict], None] | None = None,
                 on_removed: Callable[[str, tuple], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 filesystems: Sequence[str] = ()):
        """clock: the monotonic clock liveness is judged by (tests age peers with their own);
        filesystems: types to use besides the local ones (the user's ssd_filesystems)."""
        why = unsupported_filesystem(root, tuple(filesystems))
        if why is not None:
            raise UnsupportedFilesystem(f"{root} is on {why}; the SSD tier needs a local disk (SQLite's WAL shares "
                                        "memory between processes): name the type in ssd_filesystems to use it "
                                        "knowingly")
        self.root = Path(root).expanduser()
        # Links are never followed below `anchor`: the root is one of the cache directory's own
        # (`checkpoints`); without its heartbeats or blocks the tier does not open (LinkedDirectory).
        self.anchor = self.root.parent
        make_private_dir(self.root, self.anchor)
        make_private_dir(self.root / HEARTBEATS, self.anchor)
        self.blocks_root = make_private_dir(self.root / BLOCKS, self.anchor)
        try:
            make_private_dir(self.root / QUARANTINE, self.anchor)
        except LinkedDirectory:
            pass  # reported: the tier runs without it (a bad file stays where it is, not served)
        self.ssd_budget_bytes = ssd_budget_bytes
        self.on_event, self.on_removed = on_event, on_removed
        self.index = FileIndex()
        self._lock = self.index.lock
        self._entries = self.index.entries  # (namespace, key) -> IndexEntry
        self._identities: dict[str, dict] = {}
        self._reported: set = set()
        self._unsynced: set = set()  # directories whose deletions await an fsync (the keeper's)
        self._stats = {"quarantined": 0, "restores": 0, "restore_bytes": 0, "restore_seconds": 0.0, "evicted": 0,
                       "newer_format_files": 0, "bytes_written": 0, "bytes_deduplicated": 0, "blocks_freed": 0,
                       "dropped_missing_blocks": 0, "unleased_reads": 0}
        self.catalog = Catalog(self.root / "catalog.db", clock=clock)
        self.catalog.on_late = self._late
        self.rebuilds = 0  # times the catalogue was found gone or broken and rebuilt while running
        self._reload()
        self._start()
        self.catalog.maintain = self.maintain

    def _start(self) -> None:
        """Forget dead processes, then reconcile the catalogue with the files (upkeep.py);
        with another process holding the lock, once it is free (the keeper)."""
        try:
            self.maintain()
            self._reconcile()
        except CatalogBusy:
            self.catalog.later(self._start)

    # --- the in-memory view of the catalogue ---

    def _reload(self) -> None:
        self.index.load(self.catalog.files())

    def sync(self) -> None:
        """Apply what any process committed or deleted since the last call (an indexed query).

        A catalogue that was deleted, replaced or corrupted meanwhile is reopened
        (rebuilt if need be) and reconciled with the files. A busy one waits for the next call.
        """
        try:
            if self.catalog.replaced():
                raise CatalogCorrupt("the catalogue was deleted or replaced")
            added, removed, reload = self.catalog.changes()
        except CatalogBusy:
            return
        except CatalogCorrupt:
            self.catalog.reopen()
            self.rebuilds += 1
            self._reload()
            self._start()
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
        for e in bad:  # (a busy catalogue: they stay, never served: a read checks the identity)
            self._quarantine(e.path, "identity mismatch", (e.namespace, e.key))

    def _emit(self, event: dict) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                pass  # an observer must not break the store

    def _late(self, reason: str | None) -> None:
        if reason is not None:
            self._emit({"type": "ssd_late", "reason": reason})

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

    def block_sizes(self, namespace: str) -> dict:
        """File key -> {block name: bytes} of the namespace's files (the catalogue's refs); {} when
        the catalogue cannot answer now (then no block counts as shared)."""
        try:
            rows = self.catalog.query("SELECT r.key, r.block, b.bytes FROM refs r JOIN blocks b ON b.name = r.block "
                                      "WHERE r.namespace=?", (namespace,))
        except Exception:
            return {}
        out: dict = {}
        for key, name, nbytes in rows:
            out.setdefault(key, {})[name] = nbytes
        return out

    def entries(self) -> list[IndexEntry]:
        self.sync()
        return self.index.snapshot()

    # --- commits and deletions (catalogue transactions) ---

    def prepare_path(self, namespace: str, tokens: Sequence[int]) -> Path:
        """A new final path for a checkpoint of `tokens` (a fresh tag: no write replaces a
        file in place, so a failed commit leaves the old version whole); creates the namespace dir."""
        d = make_private_dir(self.root / validate_namespace(namespace), self.anchor)
        return d / f"{token_key(tokens)}.{os.urandom(4).hex()}{SUFFIX}"

    def commit(self, tmp: Path, info: FileInfo, write_id: int | None = None, blocks: Sequence[str] = ()) -> None:
        """Record a finished temp file with its block references, end the write's claims, then
        rename it into place, last, in the same transaction (writer thread). `blocks`: what
        the write claimed (checked: still claimed and recorded, else LostClaims)."""
        h, path = info.header, Path(info.path)
        k = (h.namespace, token_key(h.tokens))
        after, renamed = AfterCommit(self, "commit"), False
        try:
            with self.catalog.transaction("commit") as db:
                if write_id is not None and not self.catalog.claims_held(db, write_id, blocks):
                    raise LostClaims(f"{path.name}: blocks this write relied on were freed meanwhile; "
                                     "written again later")
                old = self.catalog.file(*k, db=db)
                freed = self.catalog.add_file(db, _row(path, h), written=True)
                if write_id is not None:
                    freed += self.catalog.release(db, write_id)
                after.blocks = self.catalog.free_blocks(db, freed)
                if old is not None and old.path != str(path):
                    after.files.append(Path(old.path))
                fault("commit.rename")
                safe_dirs.replace(tmp, path, self.anchor)
                renamed = True
                after.dirs.add(path.parent)
                fault("commit.renamed")
        except BaseException:
            if renamed:  # the COMMIT failed: nothing may point at the new file
                safe_dirs.unlink(path, self.anchor)
            raise
        after.run()

    def release(self, write_id: int) -> None:
        """End a failed or skipped write's block claims; free what nothing references."""
        with changing(self, "release") as (db, after):
            after.blocks = self.catalog.free_blocks(db, self.catalog.release(db, write_id))

    def fsync_later(self, dirs: set) -> None:
        """Directories that lost files: the keeper fsyncs them within a second."""
        with self._lock:
            first = not self._unsynced and bool(dirs)
            self._unsynced |= dirs
        if first:
            self.catalog.later(self._fsync_unsynced)

    def _fsync_unsynced(self) -> None:
        """The keeper's deferred directory fsyncs; one that fails is tried again at its next turn
        (a deletion a power cut undoes meanwhile is found again by reconcile or gc)."""
        with self._lock:
            dirs, self._unsynced = self._unsynced, set()
        failed = set()
        for d in sorted(dirs):
            try:
                fsync_dir(d, "keep.fsync")
            except FileNotFoundError:
                pass
            except OSError:
                failed.add(d)
        self.fsync_later(failed)

    def count_write(self, written: int, deduplicated: int) -> None:
        with self._lock:
            self._stats["bytes_written"] += written
            self._stats["bytes_deduplicated"] += deduplicated

    def publish(self, info: FileInfo) -> IndexEntry:
        """After `commit`: supersede older files this one serves, then apply the SSD cap."""
        h = info.header
        self.sync()
        k = (h.namespace, token_key(h.tokens))
        with self._lock:
            older = [(e.namespace, e.key) for e in self._entries.values() if h.trimmable and e.namespace == h.namespace
                     and len(e) < len(h.tokens) and len(e) >= h.min_reusable_offset and h.tokens[: len(e)] == e.tokens]
        with changing(self, "publish") as (db, after):
            self.catalog.apply_touches(db)  # the cap sees this process's latest uses
            for ns, key in older:
                self._delete(db, after, ns, key, "superseded")
            since = enforce_budget(self, db, after, keep=k)  # (capacity.py: a chunk per transaction)
        evict_rest(self, k, since)
        self.sync()
        with self._lock:
            e = self._entries.get(k)
            return replace(e, _arr=None) if e is not None else IndexEntry.from_row(_row(Path(info.path), h))

    def _delete(self, db, after: AfterCommit, ns: str, key: str, reason: str) -> bool:
        """Drop (ns, key) unless pinned or leased (inside a transaction); its file goes after COMMIT."""
        row = self.catalog.file(ns, key, db=db)
        if row is None or not self.catalog.deletable(db, ns, key):
            return False
        after.blocks += self.catalog.free_blocks(db, self.catalog.drop_file(db, ns, key))
        after.files.append(Path(row.path))
        after.evicted += 1
        after.events.append({"type": "evict", "path": row.path, "reason": reason, "nbytes": row.file_bytes})
        return True

    def remove(self, keys, reason: str = "removed", label: str = "remove") -> int:
        """Delete the files of these (namespace, key) that no name pins and no reader leases
        (short transactions of a few files each); how many went. CatalogBusy if the lock does not come."""
        keys, removed = list(keys), 0
        for i in range(0, len(keys), 64):
            with changing(self, label) as (db, after):
                removed += sum(self._delete(db, after, ns, key, reason) for ns, key in keys[i : i + 64])
        self.sync()
        return removed

    def clear(self) -> None:
        """Delete every catalogued checkpoint that no name pins and no reader leases."""
        self.remove(self.catalog.query("SELECT namespace, key FROM files"), "cleared", "clear")

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
        s["late_reason"] = self.catalog.late
        return s

    def close(self) -> None:
        self.catalog.close()
