"""The catalogue: one SQLite database per cache directory, shared by every process.

Several kernels use one cache directory at once. The catalogue is what they
agree on: which checkpoint files exist (with everything a lookup needs:
namespace, token ids, length, bytes, minimum reusable offset, trimmability,
format version, created, last used), which blocks exist and which manifests
reference them, which blocks a writer is about to reference (pending), which
files are pinned by a name, which are being read (leases), in-flight
generation records, and which processes are alive with how many writes
pending. Every process keeps an in-memory view of
the files and follows the `changes` log (an indexed range query per lookup),
so a file one kernel commits is found by every other on its next lookup.

Every deletion (cap, supersession, clear, quarantine) is one transaction that
checks pins and live leases first; a commit renames its file into place in
the transaction that records it, so a deletion can never unlink a newer copy.
A block leaves only in a transaction that finds no manifest referencing it
and no live writer's pending claim on it.

Files stay the truth for bytes: a missing or corrupt database is set aside
and rebuilt from file headers (the store does the scan) and from the named
checkpoint records (`named.py`). WAL mode; one connection per process,
shared by its threads under a lock.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

SCHEMA_VERSION = 2
KEEP_CHANGES = 20_000  # older change records are pruned; a process that fell further behind reloads
HEARTBEAT_S = 1.0
LEASE_TTL_S = 600.0  # a lease older than this is stale even if its process lives (a hung read)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files(
    namespace TEXT NOT NULL, key TEXT NOT NULL, path TEXT NOT NULL, length INTEGER NOT NULL,
    tokens BLOB NOT NULL, file_bytes INTEGER NOT NULL, kv_bytes INTEGER NOT NULL,
    min_reusable_offset INTEGER NOT NULL, trimmable INTEGER NOT NULL, format_version INTEGER NOT NULL,
    created REAL NOT NULL, last_used REAL NOT NULL, identity TEXT NOT NULL, block_bytes INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY(namespace, key));
CREATE TABLE IF NOT EXISTS blocks(name TEXT PRIMARY KEY, bytes INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS refs(namespace TEXT NOT NULL, key TEXT NOT NULL, block TEXT NOT NULL,
    PRIMARY KEY(namespace, key, block));
CREATE INDEX IF NOT EXISTS refs_block ON refs(block);
CREATE TABLE IF NOT EXISTS pending(block TEXT NOT NULL, pid INTEGER NOT NULL, write_id INTEGER NOT NULL,
    since REAL NOT NULL);
CREATE INDEX IF NOT EXISTS pending_block ON pending(block);
CREATE INDEX IF NOT EXISTS files_lru ON files(last_used);
CREATE TABLE IF NOT EXISTS changes(seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL,
    namespace TEXT NOT NULL, key TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pins(name TEXT PRIMARY KEY, namespace TEXT NOT NULL, key TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS pins_key ON pins(namespace, key);
CREATE TABLE IF NOT EXISTS leases(id INTEGER PRIMARY KEY AUTOINCREMENT, pid INTEGER NOT NULL,
    namespace TEXT NOT NULL, key TEXT NOT NULL, since REAL NOT NULL);
CREATE INDEX IF NOT EXISTS leases_key ON leases(namespace, key);
CREATE TABLE IF NOT EXISTS inflight(request TEXT PRIMARY KEY, record TEXT NOT NULL, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS processes(pid INTEGER PRIMARY KEY, started REAL NOT NULL, heartbeat REAL NOT NULL,
    pending_writes INTEGER NOT NULL, pending_bytes INTEGER NOT NULL);
"""

_COLUMNS = ("namespace, key, path, length, tokens, file_bytes, kv_bytes, min_reusable_offset, trimmable, "
            "format_version, created, last_used, identity, block_bytes")


@dataclass
class FileRow:
    namespace: str
    key: str
    path: str
    tokens: tuple
    file_bytes: int
    kv_bytes: int
    min_reusable_offset: int
    trimmable: bool
    format_version: int
    created: float
    last_used: float
    identity: dict
    block_bytes: int = 0  # the blocks it references (format 2), shared with others
    blocks: tuple = ()  # their names (not a column: the refs table)

    def values(self) -> tuple:
        return (self.namespace, self.key, self.path, len(self.tokens), np.asarray(self.tokens, "<i4").tobytes(),
                self.file_bytes, self.kv_bytes, self.min_reusable_offset, int(self.trimmable), self.format_version,
                self.created, self.last_used, json.dumps(self.identity, sort_keys=True), self.block_bytes)

    @classmethod
    def from_sql(cls, r) -> "FileRow":
        tokens = tuple(np.frombuffer(r[4], "<i4").tolist())
        return cls(r[0], r[1], r[2], tokens, r[5], r[6], r[7], bool(r[8]), r[9], r[10], r[11], json.loads(r[12]),
                   r[13])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Catalog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.pid = os.getpid()
        self._lock = threading.RLock()
        self.closed = False  # after close(): reads see an empty catalogue, writes are refused
        self._last_heartbeat = 0.0
        try:
            self._open()
        except sqlite3.DatabaseError:
            self._set_aside()
            self._open()
        self.seq = self._pruned = self._max_seq()

    def _open(self) -> None:
        self.db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        os.chmod(self.path, 0o600)
        self._inode = os.stat(self.path).st_ino
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        if self.db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("catalogue failed its integrity check")
        with self.transaction():
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self.db.execute(statement)
            columns = {r[1] for r in self.db.execute("PRAGMA table_info(files)")}
            if "block_bytes" not in columns:  # a schema 1 catalogue: format 1 files only
                self.db.execute("ALTER TABLE files ADD COLUMN block_bytes INTEGER NOT NULL DEFAULT 0")
            self.db.execute("INSERT OR REPLACE INTO meta VALUES('schema', ?)", (str(SCHEMA_VERSION),))
            self.db.execute("INSERT OR REPLACE INTO processes VALUES(?,?,?,0,0)", (self.pid, time.time(), time.time()))

    def replaced(self) -> bool:
        """Whether the database file was deleted or replaced since this process opened it."""
        try:
            return os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            return True

    def reopen(self) -> None:
        """Start over on a fresh (or another process's rebuilt) database; corrupt ones are set aside."""
        with self._lock:
            try:
                self.db.close()
            except sqlite3.Error:
                pass
            try:
                self._open()
            except sqlite3.DatabaseError:
                self._set_aside()
                self._open()
            self.seq = self._pruned = 0  # everything is news to this process now

    def _set_aside(self) -> None:
        """A corrupt database is kept as evidence and replaced by a fresh one."""
        try:
            self.db.close()
        except Exception:
            pass
        stamp = time.time_ns()
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(self.path) + suffix)
            if p.exists():
                os.replace(p, p.with_name(f"{p.name}.corrupt.{stamp}"))

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction: other processes' writes wait (BEGIN IMMEDIATE)."""
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield self.db
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def query(self, sql: str, args: tuple = ()) -> list:
        with self._lock:
            return [] if self.closed else self.db.execute(sql, args).fetchall()

    def _max_seq(self) -> int:
        return self.query("SELECT COALESCE(MAX(seq), 0) FROM changes")[0][0]

    # --- files ---

    def files(self) -> list[FileRow]:
        return [FileRow.from_sql(r) for r in self.query(f"SELECT {_COLUMNS} FROM files")]

    def file(self, ns: str, key: str) -> FileRow | None:
        rows = self.query(f"SELECT {_COLUMNS} FROM files WHERE namespace=? AND key=?", (ns, key))
        return FileRow.from_sql(rows[0]) if rows else None

    def add_file(self, db: sqlite3.Connection, row: FileRow) -> list[str]:
        """Record a file and its block references (inside a transaction, after it was
        renamed into place); returns the blocks a replaced version referenced alone."""
        old = self._drop_refs(db, row.namespace, row.key)
        db.execute(f"INSERT OR REPLACE INTO files({_COLUMNS}) VALUES({','.join('?' * 14)})", row.values())
        db.executemany("INSERT OR IGNORE INTO refs VALUES(?,?,?)", [(row.namespace, row.key, b) for b in row.blocks])
        db.execute("INSERT INTO changes(op, namespace, key) VALUES('add', ?, ?)", (row.namespace, row.key))
        return sorted(set(old) - set(row.blocks))

    def drop_file(self, db: sqlite3.Connection, ns: str, key: str) -> list[str]:
        """Forget a file; returns the blocks it referenced (candidates for `free_blocks`)."""
        db.execute("DELETE FROM files WHERE namespace=? AND key=?", (ns, key))
        db.execute("INSERT INTO changes(op, namespace, key) VALUES('del', ?, ?)", (ns, key))
        return self._drop_refs(db, ns, key)

    def _drop_refs(self, db, ns: str, key: str) -> list[str]:
        names = [r[0] for r in db.execute("SELECT block FROM refs WHERE namespace=? AND key=?", (ns, key))]
        db.execute("DELETE FROM refs WHERE namespace=? AND key=?", (ns, key))
        return names

    # --- blocks (format 2) ---

    def reserve_blocks(self, names: list[str], write_id: int) -> set[str]:
        """Claim blocks a write will reference (no process frees them meanwhile);
        returns those not recorded as present."""
        with self.transaction() as db:
            now = time.time()
            db.executemany("INSERT INTO pending VALUES(?,?,?,?)", [(n, self.pid, write_id, now) for n in set(names)])
            present = {n for n in set(names) if db.execute("SELECT 1 FROM blocks WHERE name=?", (n,)).fetchone()}
        return set(names) - present

    def add_blocks(self, sizes: dict[str, int], db: sqlite3.Connection | None = None) -> None:
        """Record blocks on disk (in the caller's transaction when given)."""
        if db is None:
            with self.transaction() as db:
                return self.add_blocks(sizes, db)
        db.executemany("INSERT OR REPLACE INTO blocks VALUES(?,?,?)", [(n, b, time.time()) for n, b in sizes.items()])

    def release(self, db: sqlite3.Connection, write_id: int) -> list[str]:
        """End a write's claims (its manifest now references the blocks, or it failed)."""
        names = [r[0] for r in db.execute("SELECT block FROM pending WHERE pid=? AND write_id=?", (self.pid, write_id))]
        db.execute("DELETE FROM pending WHERE pid=? AND write_id=?", (self.pid, write_id))
        return names

    def free_blocks(self, db: sqlite3.Connection, names=None, dry_run: bool = False) -> list[tuple[str, int]]:
        """Forget the blocks among `names` (all when None) that no manifest references and
        no live writer claims; returns (name, bytes) of each, for the caller to unlink
        (dry_run: only list them)."""
        now = time.time()
        for pid, since in db.execute("SELECT pid, MAX(since) FROM pending GROUP BY pid").fetchall():
            if not pid_alive(pid) or now - since > LEASE_TTL_S:
                db.execute("DELETE FROM pending WHERE pid=?", (pid,))
        if names is None:
            names = [r[0] for r in db.execute("SELECT name FROM blocks")]
        out = []
        for n in set(names):
            if db.execute("SELECT 1 FROM refs WHERE block=? LIMIT 1", (n,)).fetchone():
                continue
            if db.execute("SELECT 1 FROM pending WHERE block=? LIMIT 1", (n,)).fetchone():
                continue
            row = db.execute("SELECT bytes FROM blocks WHERE name=?", (n,)).fetchone()
            if not dry_run:
                db.execute("DELETE FROM blocks WHERE name=?", (n,))
            out.append((n, row[0] if row else 0))
        return out

    def drop_block(self, db: sqlite3.Connection, name: str) -> None:
        db.execute("DELETE FROM blocks WHERE name=?", (name,))

    def blocks(self) -> dict[str, int]:
        return dict(self.query("SELECT name, bytes FROM blocks"))

    def block_totals(self) -> tuple[int, int]:
        """(blocks, bytes) recorded: an aggregate, for stats read many times a second."""
        rows = self.query("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM blocks")
        return tuple(rows[0]) if rows else (0, 0)


    def deletable(self, db: sqlite3.Connection, ns: str, key: str) -> bool:
        """Neither pinned by a name nor leased by a live reader (inside a transaction)."""
        if db.execute("SELECT 1 FROM pins WHERE namespace=? AND key=?", (ns, key)).fetchone():
            return False
        now = time.time()
        for pid, since in db.execute("SELECT pid, since FROM leases WHERE namespace=? AND key=?", (ns, key)):
            if now - since < LEASE_TTL_S and pid_alive(pid):
                return False
        return True

    def touch(self, ns: str, key: str) -> None:
        with self.transaction() as db:
            db.execute("UPDATE files SET last_used=? WHERE namespace=? AND key=?", (time.time(), ns, key))

    def changes(self) -> tuple[list[FileRow], list[tuple], bool]:
        """Files added and (namespace, key) removed since the last call; reload=True when
        this process fell behind the pruned log and must reload every row."""
        with self._lock:
            rows = self.query("SELECT seq, op, namespace, key FROM changes WHERE seq > ? ORDER BY seq", (self.seq,))
            if not rows:
                return [], [], False
            last = {(ns, key): op for _, op, ns, key in rows}
            # fell behind the pruned log, or so much changed that one full read is cheaper
            reload = (rows[0][0] > self.seq + 1 and self.seq > 0) or len(last) > 256
            self.seq = rows[-1][0]
            if reload:
                return [], [], True
            added = [self.file(ns, key) for (ns, key), op in last.items() if op == "add"]
            removed = [k for k, op in last.items() if op == "del"]
            if self.seq - self._pruned > KEEP_CHANGES // 10:  # now and then, forget old history
                self._pruned = self.seq
                self.db.execute("DELETE FROM changes WHERE seq < ?", (self.seq - KEEP_CHANGES,))
            return [r for r in added if r is not None], removed, reload

    def total_bytes(self, db: sqlite3.Connection) -> int:
        """Unique bytes on disk: every file (manifest) once, every block once."""
        return (db.execute("SELECT COALESCE(SUM(file_bytes), 0) FROM files").fetchone()[0]
                + db.execute("SELECT COALESCE(SUM(bytes), 0) FROM blocks").fetchone()[0])

    def lru(self, db: sqlite3.Connection) -> list[tuple]:
        return db.execute("SELECT namespace, key, path, file_bytes FROM files ORDER BY last_used").fetchall()

    # --- pins, leases ---

    def set_pin(self, name: str, ns: str | None, key: str | None) -> None:
        with self.transaction() as db:
            if ns is None:
                db.execute("DELETE FROM pins WHERE name=?", (name,))
            else:
                db.execute("INSERT OR REPLACE INTO pins VALUES(?,?,?)", (name, ns, key))

    def pins(self) -> dict:
        return {name: (ns, key) for name, ns, key in self.query("SELECT name, namespace, key FROM pins")}

    @contextmanager
    def lease(self, ns: str, key: str):
        """While held, no process deletes this file."""
        with self.transaction() as db:
            lease_id = db.execute("INSERT INTO leases(pid, namespace, key, since) VALUES(?,?,?,?)",
                                  (self.pid, ns, key, time.time())).lastrowid
        try:
            yield
        finally:
            with self.transaction() as db:
                db.execute("DELETE FROM leases WHERE id=?", (lease_id,))

    # --- in-flight records ---

    def inflight_put(self, request: str, record: dict) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO inflight VALUES(?,?,?)", (request, json.dumps(record), time.time()))

    def inflight_get(self, request: str) -> dict | None:
        rows = self.query("SELECT record FROM inflight WHERE request=?", (request,))
        return json.loads(rows[0][0]) if rows else None

    def inflight_delete(self, request: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM inflight WHERE request=?", (request,))

    def inflight_all(self) -> list[dict]:
        return [json.loads(r[0]) for r in self.query("SELECT record FROM inflight")]

    # --- processes ---

    def heartbeat(self, pending_writes: int, pending_bytes: int, force: bool = False) -> None:
        now = time.time()
        if self.closed or (not force and now - self._last_heartbeat < HEARTBEAT_S):
            return
        self._last_heartbeat = now
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO processes VALUES(?, COALESCE((SELECT started FROM processes "
                       "WHERE pid=?), ?), ?, ?, ?)", (self.pid, self.pid, now, now, pending_writes, pending_bytes))

    def processes(self) -> list[dict]:
        """Live processes on this directory (dead ones and their leases are cleared)."""
        rows = self.query("SELECT pid, started, heartbeat, pending_writes, pending_bytes FROM processes")
        dead = [r[0] for r in rows if r[0] != self.pid and not pid_alive(r[0])]
        if dead:
            with self.transaction() as db:
                for pid in dead:
                    db.execute("DELETE FROM processes WHERE pid=?", (pid,))
                    db.execute("DELETE FROM leases WHERE pid=?", (pid,))
        keys = ("pid", "started", "heartbeat", "pending_writes", "pending_bytes")
        return [dict(zip(keys, r)) for r in rows if r[0] not in dead]

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            try:
                with self.transaction() as db:
                    db.execute("DELETE FROM processes WHERE pid=?", (self.pid,))
                    db.execute("DELETE FROM leases WHERE pid=?", (self.pid,))
            except sqlite3.Error:
                pass
            self.db.close()
            self.closed = True
