"""Keeping the SSD tier and the disk in agreement: reconciliation at start,
quarantine of bad files and blocks, gc, and full verification.

A mixin of CheckpointStore (store.py), kept apart so the store reads as
lookup, restore, commit and delete. Every removal is a catalogue
transaction: a block is unlinked only in the transaction that finds no
manifest referencing it and no live writer claiming it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np

from ...kv.tokens import legacy_token_key, token_key
from ..catalog import pid_alive
from . import blocks
from . import format as fmt
from .blocks import CorruptBlock
from .format import CorruptCheckpoint, NewerFormat
from .reader import MissingBlock, read_tensors

NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
STALE_TEMP_S = 3600.0
SUFFIX = ".ckpt"
QUARANTINE = "quarantine"
BLOCKS = "blocks"


class Upkeep:
    def _namespace_dirs(self) -> list[Path]:
        return [d for d in sorted(self.root.iterdir())
                if d.is_dir() and d.name not in (QUARANTINE, BLOCKS) and NAMESPACE_RE.fullmatch(d.name)]

    def _reconcile(self) -> None:
        """Make the catalogue match the files: drop rows without a (readable, current-format)
        file, index files without a row, quarantine files whose header is bad; then the blocks."""
        on_disk = {}  # path -> namespace directory
        for d in self._namespace_dirs():
            self._clean_stale_temps(d)
            on_disk.update({d / n: d.name for n in os.listdir(d) if n.endswith(SUFFIX) and not n.startswith(".")})
        by_path = {Path(e.path): k for k, e in self._entries.items()}
        with self.catalog.transaction() as db:
            for path, k in by_path.items():
                if path not in on_disk:
                    self._drop(db, *k)
        for path, ns in sorted(on_disk.items()):
            try:
                h = fmt.read_header(path)
                names = (token_key(h.tokens),) + ((legacy_token_key(h.tokens),) if h.version == 1 else ())
                if h.namespace != ns or path.name[: -len(SUFFIX)] not in names:
                    raise CorruptCheckpoint("file name or directory does not match its header")
            except FileNotFoundError:
                continue
            except NewerFormat:  # a newer build's file: not served, not ours to judge or delete
                self._stats["newer_format_files"] += 1
                if path in by_path:  # no row for it either
                    with self.catalog.transaction() as db:
                        self._drop(db, *by_path[path])
                continue
            except (CorruptCheckpoint, OSError) as exc:
                self._quarantine(path, getattr(exc, "reason", None) or repr(exc), by_path.get(path))
                continue
            known = self._entries.get((h.namespace, token_key(h.tokens)))
            if known is None or known.file_bytes != h.file_size or Path(known.path) != path:
                with self.catalog.transaction() as db:
                    freed = self.catalog.add_file(db, self._row(path, h))
                    self._unlink_blocks(self.catalog.free_blocks(db, freed))
        self._reconcile_blocks()
        self.sync()

    def _reconcile_blocks(self, free: bool = True) -> None:
        """Block files without a row are recorded (then, with `free`, removed if nothing
        references or claims them); rows whose file vanished are dropped (a later
        write of that block brings it back)."""
        known = self.catalog.blocks()
        d = self.blocks_root
        self._clean_stale_temps(d)
        on_disk = {n[: -len(blocks.SUFFIX)]: d / n for n in os.listdir(d)
                   if n.endswith(blocks.SUFFIX) and not n.startswith(".")}
        unknown = {}
        for name, p in on_disk.items():
            if name not in known:
                try:
                    unknown[name] = os.stat(p).st_size
                except OSError:
                    pass
        if unknown:
            self.catalog.add_blocks(unknown)
        with self.catalog.transaction() as db:
            for name in set(known) - set(on_disk):
                self.catalog.drop_block(db, name)
            if free:
                self._unlink_blocks(self.catalog.free_blocks(db, list(unknown)))

    def _unlink_blocks(self, freed: list[tuple[str, int]]) -> None:
        for name, _ in freed:
            try:
                os.unlink(blocks.block_path(self.blocks_root, name))
            except OSError:
                pass
        self._stats["blocks_freed"] += len(freed)

    def _drop(self, db, ns: str, key: str) -> None:
        """Forget a file's row and free the blocks only it referenced (inside a transaction)."""
        self._unlink_blocks(self.catalog.free_blocks(db, self.catalog.drop_file(db, ns, key)))

    def _clean_stale_temps(self, d: Path, dry_run: bool = False) -> list[Path]:
        """Temp files no writer will finish: their process is gone, or they are over an hour old."""
        stale, now = [], time.time()
        for name in os.listdir(d):
            if name.startswith(".") and name.endswith(".tmp"):
                parts = name.split(".")  # "", <key>, "ckpt"|"blk", <pid>, <n>, "tmp"
                try:
                    dead = len(parts) == 6 and parts[3].isdigit() and not pid_alive(int(parts[3]))
                    if dead or now - os.stat(d / name).st_mtime > STALE_TEMP_S:
                        stale.append(d / name)
                except OSError:
                    pass
        for p in [] if dry_run else stale:
            try:
                os.unlink(p)
            except OSError:
                pass
        return stale

    def _quarantine(self, path: Path, reason: str, k: tuple | None = None) -> None:
        """Move a bad file aside (in a catalogue transaction); a failed move is reported, the file kept."""
        dest = self.root / QUARANTINE / f"{path.parent.name}.{path.name}.{time.time_ns()}"
        with self.catalog.transaction() as db:
            row = self.catalog.file(*k) if k else None
            if row is not None and row.path == str(path):
                self._drop(db, *k)
            try:
                os.replace(path, dest)
            except FileNotFoundError:
                return  # another process moved or removed it first
            except OSError as exc:
                self._emit({"type": "quarantine_failed", "path": str(path), "reason": reason, "error": str(exc)})
                return
        self._report_quarantine(path, reason)
        self.sync()

    def quarantine_block(self, name: str, reason: str) -> None:
        """A block failed verification: move it aside and forget it. The manifests that use
        it stay (misses until a write of the same KV brings the block back); nothing else moves."""
        path = blocks.block_path(self.blocks_root, name)
        dest = self.root / QUARANTINE / f"block.{name}.{time.time_ns()}"
        with self.catalog.transaction() as db:
            self.catalog.drop_block(db, name)
            try:
                os.replace(path, dest)
            except FileNotFoundError:
                return
            except OSError as exc:
                self._emit({"type": "quarantine_failed", "path": str(path), "reason": reason, "error": str(exc)})
                return
        self._report_quarantine(path, reason)

    def _report_quarantine(self, path: Path, reason: str) -> None:
        self._stats["quarantined"] += 1
        if str(path) not in self._reported:
            self._reported.add(str(path))
            self._emit({"type": "quarantine", "path": str(path), "reason": reason})

    def _drop_vanished(self, k: tuple, path: Path) -> None:
        """A catalogued file that is gone (removed behind the catalogue's back): forget it."""
        with self.catalog.transaction() as db:
            row = self.catalog.file(*k)
            if row is not None and row.path == str(path) and not os.path.exists(path):
                self._drop(db, *k)
        self.sync()

    def verify_all(self) -> list[tuple]:
        """Re-read and re-hash every indexed file and its blocks; quarantine the bad ones."""
        bad = []
        for e in self.entries():
            try:
                h = fmt.read_header(e.path)
                if h.identity != self._identities.get(h.namespace, h.identity):
                    raise CorruptCheckpoint("identity mismatch")
                read_tensors(e.path, h, lambda n, dt, sh: np.empty(sh, fmt.host_dtype(dt)), self.blocks_root)
            except (FileNotFoundError, NewerFormat, MissingBlock):
                continue
            except CorruptBlock as exc:
                self.quarantine_block(exc.name, exc.reason)
                bad.append((blocks.block_path(self.blocks_root, exc.name), exc.reason))
            except (CorruptCheckpoint, OSError) as exc:
                reason = getattr(exc, "reason", None) or repr(exc)
                self._quarantine(e.path, reason, (e.namespace, e.key))
                bad.append((e.path, reason))
        return bad

    def gc(self, dry_run: bool = False) -> dict:
        """Quarantined files, temp files of crashed writers and blocks no manifest
        references (and no live writer claims): what goes, listed."""
        quarantined = sorted((self.root / QUARANTINE).iterdir())
        temps = [p for d in self._namespace_dirs() + [self.blocks_root] for p in self._clean_stale_temps(d, dry_run=True)]
        self._reconcile_blocks(free=False)  # block files a killed writer left without a row get one
        with self.catalog.transaction() as db:
            freed = self.catalog.free_blocks(db, dry_run=dry_run)
            if not dry_run:
                self._unlink_blocks(freed)
        if not dry_run:
            for p in quarantined + temps:
                try:
                    os.unlink(p)
                except OSError:
                    pass
        return {"quarantine_removed": [str(p) for p in quarantined], "temp_removed": [str(p) for p in temps],
                "blocks_removed": [n for n, _ in freed], "block_bytes_removed": sum(b for _, b in freed)}

