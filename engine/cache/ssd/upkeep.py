"""Keeping the SSD tier and the disk in agreement: reconciliation at start and in
gc, the sweep of dead processes, quarantine, dropping files that lost a
block, gc, and full verification.

A mixin of CheckpointStore (store.py), kept apart so the store reads as
lookup, restore, commit and delete. Every decision is a short catalogue
transaction that re-checks what it saw outside (a directory listing, a
header); unlinks and moves into quarantine follow its COMMIT (removal.py:
a block of that name is not written again until then). Only verified
corruption is moved: a bad hash, header or identity, never an I/O error.
"""

from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import psutil

from ...kv.tokens import legacy_token_key, token_key
from ...host import safe_dirs
from ...host.safe_dirs import Dir
from ..catalog.database import CatalogBusy
from ..faults import fault
from . import blocks
from . import format as fmt
from .blocks import CorruptBlock
from .header import CorruptCheckpoint, NewerFormat
from .tensor_read import MissingBlock, read_tensors
from .layout import BLOCKS, MANIFEST_NAME_RE, NAMESPACE_RE, QUARANTINE, SUFFIX
from .removal import AfterCommit, changing

STALE_TEMP_S = 3600.0  # temp files of older builds (named by pid) are stale after this
CHUNK = 64  # files or blocks decided per transaction: the write lock is held briefly


class Upkeep:
    def _namespace_dirs(self) -> list[Path]:
        """The namespaces' directories; one that is a link is reported and left out (host/safe_dirs.py)."""
        with Dir(self.root, self.anchor) as d:
            return [self.root / n for n in d.subdirs(lambda n: n not in (QUARANTINE, BLOCKS)
                                                     and NAMESPACE_RE.fullmatch(n) is not None)]

    def _listing(self, d: Path) -> list[str] | None:
        """The names in directory `d`, never through a link (None: a link, or unreadable)."""
        try:
            return safe_dirs.listdir(d, self.anchor)
        except OSError:
            return None

    # --- reconciliation ---

    def _reconcile(self, remove_broken: bool = False) -> list[str]:
        """Make the catalogue match the files: record block files without a row, drop rows
        whose file vanished, index complete files without a row (of several versions of one
        checkpoint: the indexed one, else the newest complete one), remove versions that
        lost to another, quarantine files with a bad header, and free recorded blocks no one
        uses. remove_broken (gc): files that reference a lost block are removed too.
        Returns the paths removed."""
        try:
            dirs = self._namespace_dirs()
        except OSError:  # the root is gone or was swapped for a link: nothing to reconcile with
            return []
        unknown = self._reconcile_blocks()
        headers: dict[tuple, list] = defaultdict(list)  # (ns, key) -> [(path, header)]
        newer = set()  # files of a newer format: no row (not served), left alone
        listed = set()  # the namespaces whose files were seen: rows elsewhere are not judged
        for d in dirs:
            self._clean_stale_temps(d)
            names = self._listing(d)
            if names is None:
                continue
            listed.add(d.name)
            for name in names:
                if name.endswith(SUFFIX) and not name.startswith("."):
                    found = self._read_named(d / name, d.name)
                    if found == "newer":
                        newer.add(str(d / name))
                    elif found is not None:
                        headers[(found[1].namespace, token_key(found[1].tokens))].append(found)
        on_disk = {(k, str(p)) for k, files in headers.items() for p, _ in files}
        with self._lock:
            unserved = [(k, e.path) for k, e in self._entries.items()
                        if (k, str(e.path)) not in on_disk and Path(e.path).parent.name in listed]
        removed = []
        for k, path in unserved:
            self._drop_vanished(k, path, unreadable=str(path) in newer)
        keys = sorted(headers)
        for i in range(0, len(keys), CHUNK):
            with changing(self, "reconcile") as (db, after):
                for k in keys[i : i + CHUNK]:
                    self._settle(db, after, k, headers[k], remove_broken)
            removed += [str(p) for p in after.files]
        self._free_unused(unknown)
        self.sync()
        return removed

    def _read_named(self, path: Path, namespace: str):
        """(path, header) of a checkpoint file whose name and place match its header; a bad
        one is quarantined, an unreadable or newer one left alone (None)."""
        try:
            h = fmt.read_header(path)
            m = MANIFEST_NAME_RE.fullmatch(path.name)
            names = (token_key(h.tokens),) + ((legacy_token_key(h.tokens),) if h.version == 1 else ())
            if h.namespace != namespace or m is None or m.group(1) not in names:
                raise CorruptCheckpoint("file name or directory does not match its header")
            return path, h
        except NewerFormat:  # a newer build's file: not served, not ours to judge or delete
            with self._lock:
                self._stats["newer_format_files"] += 1
            return "newer"
        except CorruptCheckpoint as exc:
            self._quarantine(path, exc.reason, None)
        except OSError:  # vanished, or unreadable now: not evidence of anything
            pass
        return None

    def _settle(self, db, after, k: tuple, files: list, remove_broken: bool) -> None:
        """One checkpoint's files against its row (inside a transaction: a commit in progress
        elsewhere has finished, and the row's file, if it exists, is the current version)."""
        row = self.catalog.file(*k, db=db)
        keep = row.path if row is not None and os.path.exists(row.path) else None
        if keep is None:
            complete = [(h.created, str(p), h) for p, h in files if os.path.exists(p) and self._complete(db, h)]
            if complete:
                _, keep, h = max(complete)
                after.blocks += self.catalog.free_blocks(db, self.catalog.add_file(db, self._row(Path(keep), h)))
        for p, h in files:
            if str(p) != keep and (keep is not None or remove_broken):
                after.files.append(p)  # an older or unfinished version, or (gc) one that lost a block

    def _complete(self, db, h) -> bool:
        return all(db.execute("SELECT 1 FROM blocks WHERE name=?", (b.name,)).fetchone() for b in h.blocks)

    def _reconcile_blocks(self) -> list[str]:
        """Record block files without a row and drop rows whose file vanished; returns the
        names recorded (free them with `_free_unused` once the files are indexed)."""
        known = self.catalog.blocks()
        self._clean_stale_temps(self.blocks_root)
        names = self._listing(self.blocks_root)
        if names is None:  # a link (reported) or unreadable: no block is judged lost from it
            return []
        on_disk = {n[: -len(blocks.SUFFIX)] for n in names if n.endswith(blocks.SUFFIX) and not n.startswith(".")}
        unknown = {}
        for name in on_disk - set(known):
            try:
                unknown[name] = os.stat(blocks.block_path(self.blocks_root, name)).st_size
            except OSError:
                pass
        for batch in _chunks(sorted(unknown), 4 * CHUNK):
            self.catalog.add_blocks({n: unknown[n] for n in batch})
        for batch in _chunks(sorted(set(known) - on_disk), CHUNK):
            with changing(self, "reconcile") as (db, after):
                for name in batch:
                    if not blocks.block_path(self.blocks_root, name).exists():
                        self._lose_block(db, after, name)
        return sorted(unknown)

    def _free_unused(self, names: list[str]) -> None:
        for batch in _chunks(names, CHUNK):
            with changing(self, "gc") as (db, after):
                after.blocks = self.catalog.free_blocks(db, batch)

    # --- dead processes, lost files and blocks ---

    def maintain(self) -> list[tuple[str, int]]:
        """The keeper's periodic turn: forget dead processes, free what only they held,
        remove their temp files. Returns the blocks freed."""
        freed, died = self.catalog.sweep()
        if freed:
            after = AfterCommit(self, "sweep")  # (their rows went in the sweep's transaction)
            after.blocks = freed
            after.run()
        if died:
            for d in self._swept_dirs():
                self._clean_stale_temps(d)
        return freed

    def _swept_dirs(self) -> list[Path]:
        try:
            return self._namespace_dirs() + [self.blocks_root]
        except OSError:
            return []

    def _clean_stale_temps(self, d: Path, dry_run: bool = False) -> list[Path]:
        """Temp files no live process will finish (named by a dead process's tag; an older
        build's, by a dead pid or after an hour). Listed and removed through one descriptor of
        `d`: a directory that is (or becomes) a link loses nothing behind it."""
        try:
            with Dir(d, self.anchor) as opened:
                return self._stale_temps(opened, dry_run)
        except OSError:  # a link (reported) or gone: nothing to clean
            return []

    def _stale_temps(self, d: Dir, dry_run: bool) -> list[Path]:
        stale, live, now = [], None, time.time()
        for name in d.names():
            if not (name.startswith(".") and name.endswith(".tmp")):
                continue
            writer = name.split(".")[-3] if name.count(".") >= 3 else ""
            try:
                if re.fullmatch(r"[0-9a-f]{12}", writer):
                    live = self.catalog.live_tags() if live is None else live
                    if writer not in live:
                        stale.append(name)
                elif (writer.isdigit() and not psutil.pid_exists(int(writer))
                      or now - d.lstat(name).st_mtime > STALE_TEMP_S):
                    stale.append(name)
            except OSError:
                pass
        if stale and not dry_run:
            try:  # best effort: a temp file left, or a removal a power cut undoes, is found stale again
                fault("stale.unlink")
                for name in stale:
                    d.unlink(name)
                d.fsync()
            except OSError:
                pass
        return [d.path / name for name in stale]

    def _drop_vanished(self, k: tuple, path, unreadable: bool = False) -> None:
        """A catalogued file that is gone (removed behind the catalogue's back), or that this
        build cannot read (`unreadable`: a newer format's): forget it, leave the file."""
        try:
            with changing(self, "vanished") as (db, after):
                row = self.catalog.file(*k, db=db)
                if row is not None and row.path == str(path) and (unreadable or not os.path.exists(path)):
                    after.blocks = self.catalog.free_blocks(db, self.catalog.drop_file(db, *k))
        except CatalogBusy:
            with self._lock:
                self.index.forget(k)  # not served here meanwhile; the catalogue learns it later
        self.sync()

    def _drop_missing(self, k: tuple, path: Path | None = None, name: str | None = None) -> None:
        """The file indexed as k (at `path`, if given) references a block that is gone (`name`,
        or one without a row): drop that block's row and every file using it, on first sight
        (their files stay for gc, or for a later write of the same KV). Lookups then fall
        back to shorter checkpoints."""
        try:
            with changing(self, "lost") as (db, after):
                row = self.catalog.file(*k, db=db)
                if row is None or (path is not None and row.path != str(path)):
                    return
                if name is None:
                    got = db.execute("SELECT block FROM refs r WHERE namespace=? AND key=? AND NOT EXISTS "
                                     "(SELECT 1 FROM blocks WHERE name=r.block) LIMIT 1", k).fetchone()
                    name = got[0] if got else None
                recorded = name is not None and db.execute("SELECT 1 FROM blocks WHERE name=?", (name,)).fetchone()
                if name is not None and not (recorded and blocks.block_path(self.blocks_root, name).exists()):
                    self._lose_block(db, after, name)
        except CatalogBusy:
            with self._lock:
                self.index.forget(k)  # not served here meanwhile; the catalogue learns it later
        self.sync()

    def _lose_block(self, db, after, name: str, bad: bool = False) -> None:
        """Forget block `name` and every file referencing it (inside a transaction). A `bad`
        block's file goes after COMMIT (moved to quarantine), and nobody writes that block
        again meanwhile; a missing one has no file to remove (a file of that name appearing
        now is a writer's new copy, never touched)."""
        for ns, key in self.catalog.drop_block(db, name, freeing=bad):
            after.blocks += self.catalog.free_blocks(db, self.catalog.drop_file(db, ns, key))
            after.events.append({"type": "dropped", "namespace": ns, "key": key, "reason": f"block {name[:16]} is lost"})
            with self._lock:
                self._stats["dropped_missing_blocks"] += 1
        if bad:
            after.blocks.append((name, 0))  # (moved by then: this only ends its `freeing`)

    # --- quarantine ---

    def _quarantine(self, path: Path, reason: str, k: tuple | None = None) -> None:
        """Move a verified-bad file aside once its row is gone (a busy catalogue or a failed
        move leaves it, reported; it is not served meanwhile)."""
        k = k or (path.parent.name, path.name.split(".")[0])  # (a bad header: the row its name would have)

        def rows(db, after):
            row = self.catalog.file(*k, db=db)
            if row is not None and row.path == str(path):
                after.blocks += self.catalog.free_blocks(db, self.catalog.drop_file(db, *k))
        self._move_aside(path, self.root / QUARANTINE / f"{path.parent.name}.{path.name}.{time.time_ns()}", reason,
                         rows)

    def quarantine_block(self, name: str, reason: str) -> None:
        """A block failed verification: read it again from the disk, and only if that read verifies
        that it is bad move it aside; the files using it are dropped (misses until the same KV
        is written again)."""
        path = blocks.block_path(self.blocks_root, name)
        verdict = blocks.intact(path, name)  # read from the disk, not the page cache
        if verdict != blocks.CORRUPT:  # it verifies now (a fault on the way, not on the disk), or an I/O
            if verdict == blocks.UNREADABLE:  # error: a miss and a retry, never evidence (a pinned checkpoint stays)
                self._emit({"type": "unreadable", "path": str(path), "reason": reason})
            return
        self._move_aside(path, self.root / QUARANTINE / f"block.{name}.{time.time_ns()}", reason,
                         lambda db, after: self._lose_block(db, after, name, bad=True))

    def _move_aside(self, path: Path, dest: Path, reason: str, rows) -> None:
        """Drop the rows (`rows(db, after)`), then, after COMMIT, move the file: a block of that
        name written again meanwhile waits (`freeing`), a manifest's name is never reused."""
        try:
            with changing(self, "quarantine") as (db, after):
                rows(db, after)
                after.moves.append((path, dest, reason))
        except CatalogBusy:
            return
        self.sync()

    def _report_quarantine(self, path: Path, reason: str) -> None:
        with self._lock:
            self._stats["quarantined"] += 1
        if str(path) not in self._reported:
            self._reported.add(str(path))
            self._emit({"type": "quarantine", "path": str(path), "reason": reason})

    # --- gc and verification ---

    def verify_all(self) -> list[tuple]:
        """Re-read and re-hash every indexed file and its blocks: bad ones are quarantined,
        files that lost a block dropped; both listed, with unreadable ones (left as they are)."""
        bad = []
        for e in self.entries():
            try:
                h = fmt.read_header(e.path)
                if h.identity != self._identities.get(h.namespace, h.identity):
                    raise CorruptCheckpoint("identity mismatch")
                read_tensors(e.path, h, lambda n, dt, sh: np.empty(sh, fmt.host_dtype(dt)), self.blocks_root)
            except (FileNotFoundError, NewerFormat):
                continue
            except MissingBlock as exc:
                self._drop_missing((e.namespace, e.key), Path(e.path), exc.name)
                bad.append((e.path, str(exc)))
            except CorruptBlock as exc:
                self.quarantine_block(exc.name, exc.reason)
                bad.append((blocks.block_path(self.blocks_root, exc.name), exc.reason))
            except CorruptCheckpoint as exc:
                self._quarantine(Path(e.path), exc.reason, (e.namespace, e.key))
                bad.append((e.path, exc.reason))
            except OSError as exc:
                bad.append((e.path, f"unreadable (left in place): {exc}"))
        return bad

    def gc(self, dry_run: bool = False, quarantine: bool = False) -> dict:
        """Forget dead processes, reconcile (files that lost a block go), free blocks no
        file references and no one claims, remove temp files of dead writers: what goes,
        listed. Quarantined files are evidence of corruption: kept (counted in
        `quarantine_kept`) unless `quarantine`, the user's word that they may go."""
        found = [self.root / QUARANTINE / n for n in sorted(self._listing(self.root / QUARANTINE) or [])]
        quarantined = found if quarantine else []
        temps = [p for d in self._swept_dirs() for p in self._clean_stale_temps(d, dry_run=True)]
        if dry_run:
            unused = self.catalog.unreferenced_blocks(ignoring=sum(self.catalog.dead_owners(), []))
            sizes = self.catalog.blocks()
            freed, files = [(n, sizes.get(n, 0)) for n in unused], []
        else:
            freed = self.maintain()
            for k in self.catalog.files_missing_blocks():
                self._drop_missing(tuple(k))
            files = self._reconcile(remove_broken=True)
            for batch in _chunks(self.catalog.unreferenced_blocks(), CHUNK):
                with changing(self, "gc") as (db, after):
                    after.blocks = self.catalog.free_blocks(db, batch)
                freed += after.blocks
            safe_dirs.unlink_all(quarantined + temps, self.anchor)  # (a directory now a link keeps its files)
        return {"quarantine_removed": [str(p) for p in quarantined], "quarantine_kept": len(found) - len(quarantined),
                "temp_removed": [str(p) for p in temps],
                "files_removed": files, "blocks_removed": [n for n, _ in freed],
                "block_bytes_removed": sum(b for _, b in freed)}


def _chunks(items: list, n: int):
    return (items[i : i + n] for i in range(0, len(items), n))
