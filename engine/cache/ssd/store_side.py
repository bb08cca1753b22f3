"""What a read (pending_read.py) and the after-commit work (removal.py) use of their
CheckpointStore, written as Protocols so neither imports store.py (which imports both):
the arrows point one way, store -> parts."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

from ..catalog.tables import Catalog


class ReadSide(Protocol):
    blocks_root: Path
    _identities: dict

    def lease(self, k: tuple) -> tuple[int | None, str | None]: ...
    def end_lease(self, lease_id: int) -> None: ...
    def open_read(self, entry: Any, *, touch: bool = True) -> Any: ...
    def count_restore(self, read: Any, *, touch: bool = True) -> None: ...
    def quarantine_block(self, name: str, reason: str) -> None: ...
    def _quarantine(self, path: Path, reason: str, k: tuple | None = None) -> None: ...
    def _drop_vanished(self, k: tuple, path: Any, unreadable: bool = False) -> None: ...
    def _drop_missing(self, k: tuple, path: Path | None = None, name: str | None = None) -> None: ...


class RemovalSide(Protocol):
    root: Path
    anchor: Path
    blocks_root: Path
    catalog: Catalog
    _lock: threading.RLock
    _stats: dict

    def fsync_later(self, dirs: set) -> None: ...
    def _emit(self, event: dict) -> None: ...
    def _report_quarantine(self, path: Path, reason: str) -> None: ...
