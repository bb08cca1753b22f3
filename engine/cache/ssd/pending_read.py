"""One checkpoint read, split by thread (`CheckpointStore.open_read`):

    pending = store.open_read(entry)      owner: lease, descriptor, header, identity
    buffers = pending.allocate(alloc)     owner: the caller's buffers (MLX memory on restore)
    pending.fill()                        any thread: read and verify every tensor and block
    result = pending.finish(build)        owner: build(header), or CheckpointUnavailable
    pending.close()                       owner: always safe; finish() calls it

Any problem is CheckpointUnavailable (a miss) when it reaches the owner, mapped
exactly as a synchronous read maps it. Only verified corruption is quarantined:
a file whose header, hash or identity is bad (unless its path now holds another
file), a block whose bytes do not hash to its name (read twice). A missing block
drops the files using it from the index; a newer format, a vanished file, an
I/O error (EIO, EMFILE...), a busy catalogue or a bug of ours is a plain miss,
tried again by the next lookup. `fill` never raises: it keeps the error for
`finish`. No MLX here.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..faults import fault
from .blocks import CorruptBlock
from .header import CorruptCheckpoint, Header, NewerFormat, read_header
from .index import IndexEntry
from .tensor_read import MissingBlock, allocate_all, fill

from .store_side import ReadSide
from ...errors import CheckpointUnavailable  # noqa: F401 (raised here; defined in errors.py)


class PendingRead:
    def __init__(self, store: ReadSide, entry: IndexEntry, *, touch: bool = True):
        """Open `entry` (owner thread); raises CheckpointUnavailable. touch=False: a
        speculative read (prefetch) that does not count as a use of the file."""
        t0 = time.perf_counter()
        self.store, self.entry, self.touch = store, entry, touch
        self.path, self.key = entry.path, (entry.namespace, entry.key)
        self.header: Header | None = None
        self.buffers: dict | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # work time: open, fill and build (not time spent queued)
        self._fd: int | None = None
        self._lease: int | None = None
        self._lock = threading.Lock()  # close() vs a fill still using the descriptor
        want = store._identities.get(entry.namespace)
        if want is None:  # nothing to check against: a miss, not a bad file
            raise CheckpointUnavailable(f"namespace {entry.namespace} is not registered")
        self._lease, path = store.lease(self.key)  # (a busy catalogue: read unleased)
        if path is None:
            raise CheckpointUnavailable(f"{self.path}: no longer in the catalogue")
        self.path = Path(path) if path else self.path  # the version the lease holds
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self.close()
            store._drop_vanished(self.key, self.path)
            raise CheckpointUnavailable(f"{self.path}: file vanished") from None
        except OSError as exc:
            self.close()
            raise CheckpointUnavailable(f"{self.path}: {exc}") from None
        try:
            h = read_header(self._fd)
            if h.tokens != tuple(entry.tokens) or h.namespace != entry.namespace:
                raise CorruptCheckpoint("file no longer holds the indexed checkpoint")
            if h.identity != want:
                raise CorruptCheckpoint("identity mismatch")
            self.header = h
        except Exception as exc:
            self._fail(exc)
        self.seconds += time.perf_counter() - t0

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this read fills (what the restored checkpoint holds)."""
        return self.header.raw_bytes

    def allocate(self, allocate: Callable) -> dict:
        """Buffers from `allocate(name, dtype, shape)` for every tensor (owner thread)."""
        t0 = time.perf_counter()
        try:
            self.buffers = allocate_all(self.header, allocate)
        except Exception as exc:
            self._fail(exc)
        self.seconds += time.perf_counter() - t0
        return self.buffers

    def fill(self, progress: Callable[[int, int], None] | None = None) -> bool:
        """Read and verify into the buffers (any thread); False when it failed (see finish).
        progress(tokens done, tokens): on this thread, as blocks land."""
        if self.buffers is None:
            raise RuntimeError("allocate() the buffers before fill()")
        t0 = time.perf_counter()
        with self._lock:
            if self._fd is None:
                self.error = self.error or CheckpointUnavailable(f"{self.path}: read closed")
                return False
            try:
                fault("read.fill")
                fill(self._fd, self.header, self.buffers, self.store.blocks_root, progress)
            except Exception as exc:
                exc.__traceback__ = None  # frames hold views of the buffers
                self.error = exc
        self.seconds += time.perf_counter() - t0
        return self.error is None

    def finish(self, build: Callable[[Header], Any]):
        """`build(header)` after a successful fill, with the store's restore statistics
        (owner thread); CheckpointUnavailable otherwise. Closes the read."""
        t0 = time.perf_counter()
        try:
            if self.error is not None:
                self._fail(self.error)
            try:
                result = build(self.header)
            except Exception as exc:
                self._fail(exc)
        finally:
            self.close()
        self.seconds += time.perf_counter() - t0
        self.store.count_restore(self, touch=self.touch)
        return result

    def close(self) -> None:
        """Release the descriptor, the catalogue lease and the buffers (owner thread)."""
        with self._lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)
        lease, self._lease = self._lease, None
        if lease is not None:
            self.store.end_lease(lease)
        self.buffers = None

    def _fail(self, exc: BaseException):
        """Map `exc` to CheckpointUnavailable (quarantining what is bad), close, raise."""
        try:
            raise CheckpointUnavailable(f"{self.path}: {self._reason(exc)}") from None
        finally:
            self.close()

    def _reason(self, exc: BaseException) -> str:
        if isinstance(exc, CheckpointUnavailable):
            return str(exc).removeprefix(f"{self.path}: ")
        if isinstance(exc, MissingBlock):
            self.store._drop_missing(self.key, self.path, exc.name)
            return str(exc)
        if isinstance(exc, CorruptBlock):
            self.store.quarantine_block(exc.name, exc.reason)
            return exc.reason
        if isinstance(exc, CorruptCheckpoint):
            if self._fd is not None and _same_file(self._fd, self.path):
                self.store._quarantine(self.path, exc.reason, self.key)
            return exc.reason
        if isinstance(exc, (NewerFormat, OSError)):
            return str(exc)
        return f"{type(exc).__name__}: {exc} (not a problem of the file: a bug, reported; the file stays)"


def _same_file(fd: int, path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
