"""Reading the SSD tier: a read's catalogue lease, the read itself (pending_read.py) and its statistics.

A mixin of CheckpointStore (store.py), like upkeep.py: a lease keeps a
file's blocks from being freed while it is read; a busy catalogue means an
unleased read (a deletion meanwhile is a miss), never a failure.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from ..catalog.database import CatalogBusy
from .header import Header
from .index import IndexEntry
from .pending_read import PendingRead
from .removal import changing


class Reads:
    def open_read(self, entry: IndexEntry, *, touch: bool = True) -> PendingRead:
        """Start reading `entry` (owner thread): the catalogue lease, the descriptor, the
        header and its identity checks. See pending_read.py for the rest of the read."""
        return PendingRead(self, entry, touch=touch)

    def read(self, entry: IndexEntry, allocate: Callable, build: Callable[[Header], Any]):
        """Read and verify `entry`'s file through one descriptor into buffers from
        `allocate(name, dtype, shape)`, then return `build(header)` (see restore.py):
        open_read, allocate, fill and finish on the calling thread.

        Any problem is CheckpointUnavailable (a miss). Only verified corruption is
        quarantined (a bad hash, header or identity); a vanished file, a missing
        block, an I/O error or a busy catalogue is a miss, and the next lookup tries again.
        """
        pending = self.open_read(entry)
        pending.allocate(allocate)
        pending.fill()
        return pending.finish(build)

    def lease(self, k: tuple) -> tuple[int | None, str | None]:
        """Lease (namespace, key) for a read: (lease id, the file's path). (None, None): no such file
        any more; (None, "") when the catalogue is busy: read unleased (a deletion meanwhile is a miss).
        A file found referencing a lost block is dropped on the spot (a miss)."""
        try:
            got = self.catalog.lease(*k)
        except CatalogBusy:
            with self._lock:
                self._stats["unleased_reads"] += 1
            return None, ""
        if got is None:
            self.sync()
            return None, None
        lease_id, path, missing = got
        if missing:
            self.end_lease(lease_id)
            self._drop_missing(k, Path(path))
            return None, None
        return lease_id, path

    def end_lease(self, lease_id: int) -> None:
        """The read is over: its blocks may go if nothing else holds them (a busy catalogue: later)."""
        def end() -> None:
            with changing(self, "unlease") as (db, after):
                after.blocks = self.catalog.free_blocks(db, self.catalog.end_lease(db, lease_id))
        try:
            end()
        except CatalogBusy:
            self.catalog.later(end)

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
