"""The catalogue's SQLite database: connections, transactions, the schema, and
what a busy or a corrupt database means. (Its rows: tables.py.)

- One connection per thread, WAL mode: readers never wait for a writer, and
  SQLite serialises writers, across threads and processes alike.
- A write transaction is BEGIN IMMEDIATE. How long it waits for another
  process's write lock depends on who asks: a cell's thread (any thread
  not marked) waits OWNER_WAIT_S, and once such a wait ran out, only
  LATE_WAIT_S until some write succeeds again (`late` says why; RAM,
  prefill and the write queue carry on meanwhile); the catalogue's keeper thread
  KEEPER_WAIT_S; a background thread marked with `background_thread()`
  (the writer) BACKGROUND_WAIT_S. Running out is CatalogBusy: a wait, a
  deferral or a miss, never a reason to replace the database.
- Only SQLITE_CORRUPT, SQLITE_NOTADB or a failed quick_check set a database
  aside (kept as `catalog.db.corrupt.<time>`, replaced by a fresh one that
  the store rebuilds from the files).
- A failed COMMIT (a full disk) is rolled back unless SQLite already did,
  and the original error propagates.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ..faults import fault
from .schema import SCHEMA_VERSION, migrate
from ...errors import CatalogBusy, CatalogCorrupt  # noqa: F401 (raised here; defined in errors.py)

OWNER_WAIT_S = 1.0
LATE_WAIT_S = 0.05  # a cell's wait while the lock is known to be held elsewhere: a short transaction's length
KEEPER_WAIT_S = 0.5
OPEN_WAIT_S = 10.0  # opening a catalogue another process is creating (or migrating): a moment, longer when busy
BACKGROUND_WAIT_S = 60.0
# Transactions a power cut may roll back (synchronous=NORMAL: no fsync of the WAL at their
# COMMIT; the next durable COMMIT syncs them too): a read's lease and its end, and the keeper's
# bookkeeping, matter only while their process lives, and after a cut none does. A lease is
# on a hit's path: 1.9 ms median, 9 ms p99 with FULL on the test VM, 0.05 / 2.3 ms without.
# An unlease's unlinks are of blocks no file references; its "unfree" that follows is durable.
# (tests/engine/cache/test_power_loss.py checks every cut of the scenarios that lease.)
NOT_DURABLE = frozenset({"lease", "unlease", "keep"})
_BUSY, _LOCKED, _CORRUPT, _NOTADB = 5, 6, 11, 26
_thread = threading.local()


def background_thread(wait_s: float = BACKGROUND_WAIT_S) -> None:
    """Mark the calling thread as one that may wait `wait_s` for the write lock (not a cell's)."""
    _thread.wait = wait_s


class Database:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._generation = 0
        self.closed = False  # after close(): reads see an empty catalogue, writes are refused
        self.late: str | None = None  # why SSD work waits (the write lock is held elsewhere), or None
        self.on_late: Callable[[str | None], None] | None = None
        self.holds: list | None = None  # a list: (label, seconds the write lock was held) per transaction
        self._open()

    # --- opening, setting aside ---

    def _open(self) -> None:
        """Open (creating or migrating) the database. Busy means another process is creating or
        migrating it (SQLite does not always call the busy handler for the journal-mode switch):
        tried again until OPEN_WAIT_S, however loaded the machine."""
        started = time.monotonic()
        while True:
            try:
                try:
                    self._prepare(started)
                except CatalogCorrupt:
                    self._set_aside()
                    self._prepare(started)
                self.late = None  # a busy try on the way is no news once open
                return
            except CatalogBusy:
                if time.monotonic() - started >= OPEN_WAIT_S:
                    raise
                time.sleep(0.05)

    def _prepare(self, started: float) -> None:
        left = max(0.05, OPEN_WAIT_S - (time.monotonic() - started))
        try:
            db = self.connection()
            self._wait(db, left)  # journal mode and schema take the lock only on a new or older catalogue
            _private(self.path)
            self._inode = os.stat(self.path).st_ino
            db.execute("PRAGMA journal_mode=WAL")
            if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
                raise CatalogCorrupt(f"{self.path} failed its integrity check")
            try:
                version = int(db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()[0])
            except (sqlite3.OperationalError, TypeError):
                version = 0
        except sqlite3.DatabaseError as e:
            raise self._failed(e, time.monotonic() - started) from e
        if version < SCHEMA_VERSION:
            with self.transaction("schema", wait=left) as db:
                migrate(db)

    def _set_aside(self) -> None:
        """A corrupt database is kept as evidence and replaced by a fresh one."""
        self._close_connections()
        stamp = time.time_ns()
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(self.path) + suffix)
            if p.exists():
                os.replace(p, p.with_name(f"{p.name}.corrupt.{stamp}"))
        self._generation += 1

    def replaced(self) -> bool:
        """Whether the database file was deleted or replaced since this process opened it."""
        try:
            return os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            return True

    def reopen(self) -> None:
        """Start over on a fresh (or another process's rebuilt) database; a corrupt one is set aside."""
        self._generation += 1
        self._open()

    # --- connections and transactions ---

    def connection(self) -> sqlite3.Connection:
        """This thread's connection (a new one after reopen)."""
        c = getattr(self._local, "conn", None)
        if c is not None and self._local.generation == self._generation:
            return c
        c = sqlite3.connect(self.path, timeout=0, isolation_level=None, check_same_thread=False)
        self._local.wait = 0.0
        # FULL: the WAL is fsynced at every COMMIT. With NORMAL a power cut may roll back
        # committed transactions whose unlinks and renames were already durable, and lose
        # acknowledged checkpoints (tests/engine/cache/test_power_loss.py, docs/faults.md).
        c.execute("PRAGMA synchronous=FULL")
        c.execute("PRAGMA wal_autocheckpoint=0")  # the keeper checkpoints: a COMMIT stays short
        c.execute("PRAGMA recursive_triggers=ON")  # INSERT OR REPLACE keeps the totals right
        if sys.platform == "darwin":
            c.execute("PRAGMA fullfsync=ON")
            c.execute("PRAGMA checkpoint_fullfsync=ON")
        self._local.conn, self._local.generation = c, self._generation
        with self._conns_lock:
            self._conns.append(c)
        return c

    def _wait(self, db: sqlite3.Connection, wait: float | None) -> float:
        if wait is None:
            wait = getattr(_thread, "wait", None)
        if wait is None:  # a cell's thread
            wait = LATE_WAIT_S if self.late else OWNER_WAIT_S
        if getattr(self._local, "wait", None) != wait:
            db.execute(f"PRAGMA busy_timeout={int(wait * 1000)}")
            self._local.wait = wait
        return wait

    @contextmanager
    def transaction(self, label: str = "write", wait: float | None = None) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE); CatalogBusy when the lock does not come in
        time. Fault points: `<label>.begin`, `<label>.commit` (the COMMIT), `<label>.committed`."""
        if self.closed:
            raise CatalogBusy("the catalogue is closed")
        db = self.connection()
        waited = self._wait(db, wait)
        if label in NOT_DURABLE:
            db.execute("PRAGMA synchronous=NORMAL")
            try:
                with self._transaction(db, label, waited) as db:
                    yield db
            finally:
                try:
                    db.execute("PRAGMA synchronous=FULL")
                except sqlite3.Error:
                    pass  # (still in a transaction SQLite could not roll back: the next connection is FULL)
            return
        with self._transaction(db, label, waited) as db:
            yield db

    @contextmanager
    def _transaction(self, db: sqlite3.Connection, label: str, waited: float) -> Iterator[sqlite3.Connection]:
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as e:
            raise self._failed(e, waited) from e
        held = time.perf_counter()
        try:
            fault(f"{label}.begin")
            if label != "schema":
                self._began(db)
            yield db
            fault(f"{label}.commit", db)
            db.execute("COMMIT")
        except BaseException as exc:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # never hide the error that got us here
            mapped = self._failed(exc, waited) if isinstance(exc, sqlite3.DatabaseError) else exc
            if mapped is exc:
                raise
            raise mapped from exc
        if self.holds is not None:  # (benchmarks/bench_catalog.py)
            self.holds.append((label, time.perf_counter() - held))
        self._committed()
        fault(f"{label}.committed")

    def checkpoint(self) -> None:
        """Copy the WAL into the database, without waiting for any reader or writer (the keeper)."""
        self.connection().execute("PRAGMA wal_checkpoint(PASSIVE)")

    def locked_elsewhere(self) -> bool:
        """Whether another process holds the write lock for over OWNER_WAIT_S (tried with an
        empty write transaction)."""
        try:
            with self.transaction("probe", wait=OWNER_WAIT_S):
                return False
        except CatalogBusy:
            return True

    def query(self, sql: str, args: tuple = ()) -> list:
        """A read (never waits for writers in WAL mode, but for a rare checkpoint)."""
        if self.closed:
            return []
        db = self.connection()
        waited = self._wait(db, None)
        try:
            return db.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as e:
            raise self._failed(e, waited) from e

    def _began(self, db: sqlite3.Connection) -> None:
        """Hook: the first statements of every write transaction (presence.py registers the process)."""

    def _holder(self) -> str:
        """Hook (presence.py): who holds the write lock, as words for `late` ("" if unknown)."""
        return ""

    def _committed(self) -> None:
        if self.late is not None:
            self.late = None
            if self.on_late is not None:
                self.on_late(None)

    def _failed(self, exc: BaseException, waited: float) -> BaseException:
        """SQLite's error as what it means here: CatalogBusy, CatalogCorrupt, or itself."""
        code = (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF
        if code in (_CORRUPT, _NOTADB):
            return CatalogCorrupt(f"{self.path}: {exc}")
        if code not in (_BUSY, _LOCKED):
            return exc
        busy = CatalogBusy(f"the catalogue {self.path} is locked by another process (waited {waited:.1f} s)")
        if getattr(_thread, "wait", None) is None and self.late is None:  # a cell's thread: say so once
            self.late = (f"{busy}{self._holder()}: SSD reads and writes wait, RAM and prefill serve meanwhile "
                         "(a stuck process, or an open `sqlite3 catalog.db` transaction?)")
            if self.on_late is not None:
                self.on_late(self.late)
        return busy

    def _close_connections(self) -> None:
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for c in conns:
            try:
                c.close()
            except sqlite3.Error:
                pass

    def close(self) -> None:
        self.closed = True
        self._close_connections()


def _private(path: Path) -> None:
    """0600, never through a link (a catalogue file that is a link keeps its target's mode)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return
        raise
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
