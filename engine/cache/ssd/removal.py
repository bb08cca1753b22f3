"""What a catalogue transaction decided to remove, done once it committed.

Rows go first: a transaction drops the rows of files and blocks (blocks move
to `freeing`, so no one writes them again meanwhile) and records here what
goes; after COMMIT, `run()` moves bad files into quarantine, unlinks the
rest, fsyncs the directories of renames, ends the blocks' `freeing` and
only then reports (stats and events). Directories that only lost files are
fsynced by the keeper within a second (a deletion a crash undoes is found
again by reconcile or gc; the writer need not wait for it). A kill before
`run()` leaves files without rows: the next reconcile or gc removes them
(or finds them bad again), and the survivors' sweep finishes the freeing
of a dead process.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ...system import fsync_dir, unlink_quietly
from ..catalog.database import CatalogBusy
from ..faults import fault
from . import blocks

from .store_side import RemovalSide


class AfterCommit:
    def __init__(self, store: RemovalSide, label: str):
        self.store, self.label = store, label
        self.files: list[Path] = []  # unlink
        self.blocks: list[tuple[str, int]] = []  # (name, bytes) freed: unlink, then unfree
        self.dirs: set[Path] = set()  # fsync now (renames into them)
        self.moves: list[tuple[Path, Path, str]] = []  # (bad file, into quarantine, why)
        self.events: list[dict] = []
        self.evicted = 0

    def run(self) -> None:
        store = self.store
        for path, dest, reason in self.moves:
            fault(f"{self.label}.rename")
            try:
                os.replace(path, dest)
            except FileNotFoundError:
                continue  # another process moved or removed it first
            except OSError as exc:
                self.events.append({"type": "quarantine_failed", "path": str(path), "reason": reason,
                                    "error": str(exc)})
                continue
            self.dirs |= {Path(path).parent, Path(dest).parent}
            store._report_quarantine(path, reason)
        fault(f"{self.label}.unlink")
        for p in self.files:
            unlink_quietly(p)
        for name, _ in self.blocks:
            unlink_quietly(blocks.block_path(store.blocks_root, name))
        fault(f"{self.label}.unlinked")
        for d in sorted(self.dirs):
            fsync_dir(d)
        emptied = {Path(p).parent for p in self.files} | ({store.blocks_root} if self.blocks else set())
        store.fsync_later(emptied - self.dirs)
        names = [n for n, _ in self.blocks]
        if names:
            try:
                store.catalog.unfree(names)
            except CatalogBusy:
                store.catalog.later(lambda: store.catalog.unfree(names))
        with store._lock:
            store._stats["blocks_freed"] += len(self.blocks)
            store._stats["evicted"] += self.evicted
        for event in self.events:
            store._emit(event)


@contextmanager
def changing(store: RemovalSide, label: str, wait: float | None = None) -> Iterator[tuple]:
    """`with changing(store, "gc") as (db, after):` a transaction whose removals run after its COMMIT."""
    after = AfterCommit(store, label)
    with store.catalog.transaction(label, wait) as db:
        yield db, after
    after.run()
