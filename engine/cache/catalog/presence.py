"""This process's presence in a catalogue: its `procs` row, its heartbeat, and the
keeper thread that does the catalogue writes a cell's thread must not wait for.

- Registration: every write transaction inserts our row until one committed
  (a catalogue locked at start registers us when it frees); a row a peer
  swept (taking us for dead) comes back at the keeper's next turn.
- `later(fn)`: deferred work (a pin, a lease's end, a resume record's
  deletion, the start's reconciliation) run by the keeper until the lock
  comes. The keeper also records this process's pending writes, its uses
  of files (`apply_touches`, in tables.py) and, every SWEEP_S, copies the
  WAL into the database (no COMMIT does it) and runs the owner's
  maintenance (the store's: sweep the dead, free what they held).
- `processes()`: the live processes on the directory, judged by liveness.py.
"""

from __future__ import annotations

import collections
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Callable

from ...host import safe_dirs
from ...host.system import process_tag
from .database import CatalogBusy, Database
from .liveness import HEARTBEAT_S, STOPPED, Heart, Identity, Keeper, Peers, process_state

SWEEP_S = 5.0  # how often the keeper looks for dead processes
HOLDER, HOLDER_BYTES = "catalog.holder", 512  # who took the write lock last: named while others wait for it
_PROC_COLUMNS = ("owner", "tag", "pid", "host", "boot", "pidns", "start", "started", "pending_writes", "pending_bytes")


class Presence(Database):
    def __init__(self, path: Path, *, clock: Callable[[], float] = time.monotonic, identity: Identity | None = None):
        self.owner = os.urandom(8).hex()  # this open catalogue: its claims, leases and heartbeat
        self.tag = process_tag()  # this process: its temp files
        self.identity = identity or Identity.current()
        self.root = Path(path).parent
        self.anchor = self.root.parent  # below it no link is followed (host/safe_dirs.py)
        self.beats = self.root / ".heartbeats"
        self.peers = Peers(self.identity, self.owner, self.beats, clock)
        self.pending = (0, 0)  # (writes, bytes) this process has queued: the keeper records it
        self.maintain: Callable[[], object] = lambda: None  # the owner's periodic upkeep (keeper thread)
        self._registered = False
        self._later: collections.deque = collections.deque()
        self._next_sweep = 0.0
        self._holder_fd: int | None = None
        self.heart = Heart(self.beats, self.owner, self.anchor)
        try:
            super().__init__(path)
        except BaseException:
            self.heart.stop()
            raise
        self.keeper = Keeper(self._keep)

    def _began(self, db: sqlite3.Connection) -> None:
        self._hold()
        if not self._registered:
            me = self.identity
            db.execute("INSERT OR IGNORE INTO procs VALUES(?,?,?,?,?,?,?,?,0,0)",
                       (self.owner, self.tag, me.pid, me.host, me.boot, me.pidns, me.start, time.time()))
            self._local.registering = True

    def _hold(self) -> None:
        """Say in HOLDER that we hold the write lock now (one pwrite, never fsynced: only a
        process waiting for the lock reads it, and only the last to take the lock holds it)."""
        me = self.identity
        record = json.dumps({"owner": self.owner, "pid": me.pid, "host": me.host, "boot": me.boot,
                             "pidns": me.pidns, "since": time.time()}).encode()
        try:
            if self._holder_fd is None:
                self._holder_fd = os.open(self.root / HOLDER, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            os.pwrite(self._holder_fd, record.ljust(HOLDER_BYTES), 0)
        except OSError:
            pass  # (a full disk: the wait is reported without the holder)

    def _holder(self) -> str:
        """Who holds the write lock while we wait for it, and whether that process is stopped."""
        try:
            with open(self.root / HOLDER, "rb") as f:
                rec = json.loads(f.read(HOLDER_BYTES).rstrip() or b"null")
            pid, host, since = int(rec["pid"]), str(rec["host"]), float(rec["since"])
        except (OSError, ValueError, TypeError, KeyError):
            return ""
        if rec.get("owner") == self.owner:
            return " (by another thread of this process)"
        state = ""
        if self.identity.same_pids(rec):
            now = process_state(pid)
            state = (", which is stopped (SIGSTOP, Ctrl-Z or a debugger: the lock is free once it resumes "
                     "or is killed)" if now in STOPPED else ", which is gone" if now is None else "")
        return f" (held by pid {pid} on {host}{state}, since {max(0.0, time.time() - since):.0f} s)"

    def _committed(self) -> None:
        if getattr(self._local, "registering", False):
            self._registered, self._local.registering = True, False
        super()._committed()

    def reopen(self) -> None:
        super().reopen()
        self._registered = False  # a new database: we are not in it yet

    def later(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the keeper thread (which may wait for the lock) until it does not raise CatalogBusy."""
        self._later.append(fn)

    def apply_touches(self, db: sqlite3.Connection) -> bool:
        """Hook (tables.py): record pending uses of files inside `db`'s transaction; True if any."""
        return False

    def _keep(self) -> None:
        """The keeper's turn: our row and pending counts, deferred work, now and then the sweep."""
        row = self.query("SELECT pending_writes, pending_bytes FROM procs WHERE owner=?", (self.owner,))
        if not row:
            self._registered = False  # (a peer swept us: register again)
        if self.late or not self._registered or tuple(row[0]) != tuple(self.pending) or self.touched():
            try:
                with self.transaction("keep") as db:
                    db.execute("UPDATE procs SET pending_writes=?, pending_bytes=? WHERE owner=?",
                               (*self.pending, self.owner))
                    self.apply_touches(db)
            except CatalogBusy:
                return
        while self._later:
            fn = self._later.popleft()
            try:
                fn()
            except CatalogBusy:
                self._later.appendleft(fn)
                return
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_S
            self.checkpoint()
            self.maintain()

    def touched(self) -> bool:
        """Hook (tables.py): whether uses of files wait to be recorded."""
        return False

    def _procs(self) -> list[dict]:
        return [dict(zip(_PROC_COLUMNS, r)) for r in self.query(f"SELECT {', '.join(_PROC_COLUMNS)} FROM procs")]

    def processes(self) -> list[dict]:
        """The live processes on this directory (this one included); a read."""
        return [r for r in self._procs() if self.peers.alive(r)]

    def live_tags(self) -> set:
        """Process tags of live processes: their temp files are in use."""
        return {r["tag"] for r in self.processes()} | {self.tag}

    def dead_owners(self) -> tuple[list[str], list[str]]:
        """(owners of rows found dead, owners without a row: of claims, leases or freeing marks,
        or of a heartbeat that stopped before they registered)."""
        procs = self._procs()
        dead = [r["owner"] for r in procs if not self.peers.alive(r)]
        owned = "SELECT owner FROM claims UNION SELECT owner FROM leases UNION SELECT owner FROM freeing"
        orphans = [r[0] for r in self.query(f"SELECT owner FROM ({owned}) WHERE owner NOT IN (SELECT owner FROM procs)")]
        try:
            unregistered = set(safe_dirs.listdir(self.beats, self.anchor)) - {r["owner"] for r in procs} - {
                self.owner} - set(orphans)
        except OSError:  # (a link, reported: no one is judged from what it holds)
            unregistered = set()
        return dead, orphans + sorted(o for o in unregistered if not self.peers.beating(o))

    def describe(self, owner: str) -> str:
        """Who `owner` is, for an error message: this process, or another by pid and host."""
        row = [r for r in self._procs() if r["owner"] == owner]
        if owner == self.owner:
            return f"this process (pid {self.identity.pid})"
        if not row:
            return f"a process no longer registered (owner {owner[:8]}; the next sweep ends its marks)"
        alive = "alive" if self.peers.alive(row[0]) else "found dead, not yet swept"
        return f"process {row[0]['pid']} on {row[0]['host']} ({alive})"

    def forget_owners(self, owners: list[str]) -> None:
        """Dead owners are swept: their heartbeat files go, and what we saw of them."""
        for owner in owners:
            self.peers.forget(owner)
        safe_dirs.unlink_all([self.beats / owner for owner in owners], self.anchor)

    def close(self) -> None:
        """Leave: our row, leases and claims go (blocks only they kept are the next sweep's or gc's)."""
        if self.closed:
            return
        self.keeper.stop()
        self.heart.stop()  # first: killed before the row goes, we are found dead by pid or by heartbeat
        try:
            with self.transaction("close", wait=HEARTBEAT_S) as db:
                for table in ("procs", "leases", "claims"):
                    db.execute(f"DELETE FROM {table} WHERE owner=?", (self.owner,))
        except Exception:  # busy, a full or failing disk: our rows stay, peers find us dead and sweep them
            pass
        super().close()
        if self._holder_fd is not None:
            os.close(self._holder_fd)
            self._holder_fd = None
