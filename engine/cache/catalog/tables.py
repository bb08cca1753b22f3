"""The catalogue: one SQLite database per cache directory, shared by every process.

Several kernels use one cache directory at once; the catalogue is what they
agree on. Its tables:

    files    one row per checkpoint file (a manifest, or a format 1 file): what a
             lookup needs (namespace, token ids, length, bytes, minimum reusable
             offset, trimmability, format, identity, created, last used) and its path
    blocks   the content-addressed blocks on disk; `refs` says which files use which
    claims   blocks a live process needs kept: a write about to reference them
             (write_id > 0) or a read holding a lease (write_id = -lease id)
    freeing  blocks whose row is gone and whose file is being unlinked; no one
             writes them again until that is done
    leases   files being read: no cap, clear or supersession deletes them
    pins     names (named checkpoints) holding files
    inflight resume records of generations, with their owner and boundary file
    procs    the processes using the directory (liveness.py says who is alive)
    writers  which process committed each file (pid, host: kept after it exits)
    changes  a log of files added and removed: every process follows it, so a
             file one kernel commits is found by every other on its next lookup
    totals   bytes of files and blocks, kept by triggers (no scans for the cap; likewise
             files.pinned counts the pins on each file)

Rules every caller keeps (cache/ssd/store.py, cache/ssd/upkeep.py, the objects' store):
- A row goes first, its file after: a deletion drops rows (and records
  freed blocks in `freeing`) in one short transaction, then unlinks after
  COMMIT, each block under the fence (`own_freeing`, cache/ssd/removal.py), then
  `unfree`s. A commit checks its blocks and renames its new, uniquely
  named file last inside the transaction that records it.
- A block leaves only when no file references it and no live process
  claims it. A live process's claims and leases never expire by age;
  they go when it releases them or when it is found dead (`sweep`).
- Transactions hold no scans or callbacks, and no unlinks but the fence's
  (a chunk); a cell's writes are bounded or deferred (`later`, `touch`).

The calls, by table (`db`: inside the caller's `transaction(label)`; the
rest open their own; CatalogBusy when the write lock does not come in time,
database.py):

    files    files(), file(ns, key[, db]), add_file(db, row), drop_file(db, ns, key),
             changes(), least_recent(db, after), deletable(db, ns, key), touch(ns, key)
    blocks   reserve_blocks(names, write_id), add_blocks(sizes[, db]), claims_held(db, ...),
             release(db, write_id), free_blocks(db, names), unfree(names), drop_block(db, name)
    leases   lease(ns, key) -> (id, path, blocks missing), end_lease(db, id)
    pins     set_pin(name, ns, key), replace_pins(want), pins()
    inflight inflight_put / _get / _delete / _all
    procs    processes(), live_tags(), sweep(); later(fn) (presence.py)

Threads: any; one connection each (database.py). Paths are stored relative
to the directory (it may move, or be mounted elsewhere in a container).
Files stay the truth for bytes: a lost or corrupt database is rebuilt from
the files (the store).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from .presence import Presence

KEEP_CHANGES = 20_000  # older change records are pruned; a process that fell further behind reloads

_COLUMNS = ("namespace, key, path, length, tokens, file_bytes, kv_bytes, min_reusable_offset, trimmable, "
            "format_version, created, last_used, identity, block_bytes")
_JOINED = ", ".join("f." + c.strip() for c in _COLUMNS.split(","))


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


class Catalog(Presence):
    """The rows. Opening one registers this process (presence.py: its row, heartbeat and
    keeper thread); `clock`, the monotonic clock peers are judged by (tests move it)."""

    def __init__(self, path: Path, **kw):
        self._touches: dict = {}
        self.seq = self._pruned = 0
        super().__init__(path, **kw)
        self.seq = self._pruned = self._max_seq()

    def reopen(self) -> None:
        super().reopen()
        self.seq = self._pruned = 0  # everything is news to this process now

    def _keep(self) -> None:
        super()._keep()
        if self.seq - self._pruned > KEEP_CHANGES // 10:  # now and then, forget old history
            with self.transaction("prune") as db:
                db.execute("DELETE FROM changes WHERE seq < ?", (self.seq - KEEP_CHANGES,))
            self._pruned = self.seq

    # --- files ---

    def files(self) -> list[FileRow]:
        return [self._file_row(r) for r in self.query(f"SELECT {_COLUMNS} FROM files")]

    def file(self, ns: str, key: str, db: sqlite3.Connection | None = None) -> FileRow | None:
        """The row of (ns, key): inside the caller's transaction when `db` is given."""
        sql, args = f"SELECT {_COLUMNS} FROM files WHERE namespace=? AND key=?", (ns, key)
        rows = db.execute(sql, args).fetchall() if db is not None else self.query(sql, args)
        return self._file_row(rows[0]) if rows else None

    def _file_row(self, r) -> FileRow:
        row = FileRow.from_sql(r)
        row.path = str(self.root / row.path)  # (a path stored whole, by an older build, stays whole)
        return row

    def add_file(self, db: sqlite3.Connection, row: FileRow, written: bool = False) -> list[str]:
        """Record a file and its block references (replacing the row of the same tokens), and
        with `written` this process as its writer (`writers`; a file reconcile finds has none);
        returns the blocks only the replaced version referenced (candidates for `free_blocks`)."""
        old = self.drop_file(db, row.namespace, row.key, log=False)
        if written:
            db.execute("INSERT OR REPLACE INTO writers VALUES(?,?,?,?,?,?,?)", (
                row.namespace, row.key, self.owner, self.identity.pid, self.identity.host, time.time(),
                row.file_bytes + row.block_bytes))
        path = Path(row.path)
        stored = str(path.relative_to(self.root)) if path.is_relative_to(self.root) else str(path)
        db.execute(f"INSERT INTO files({_COLUMNS}) VALUES({','.join('?' * 14)})", (*row.values()[:2], stored,
                                                                                   *row.values()[3:]))
        db.executemany("INSERT OR IGNORE INTO refs VALUES(?,?,?)", [(row.namespace, row.key, b) for b in row.blocks])
        db.execute("INSERT INTO changes(op, namespace, key) VALUES('add', ?, ?)", (row.namespace, row.key))
        return sorted(set(old) - set(row.blocks))

    def drop_file(self, db: sqlite3.Connection, ns: str, key: str, log: bool = True) -> list[str]:
        """Forget a file; returns the blocks it referenced (candidates for `free_blocks`)."""
        names = [r[0] for r in db.execute("DELETE FROM refs WHERE namespace=? AND key=? RETURNING block", (ns, key))]
        if db.execute("DELETE FROM files WHERE namespace=? AND key=?", (ns, key)).rowcount and log:
            db.execute("INSERT INTO changes(op, namespace, key) VALUES('del', ?, ?)", (ns, key))
        return names

    def least_recent(self, db: sqlite3.Connection, after: tuple = (float("-inf"), 0), limit: int = 64) -> list:
        """(namespace, key, (last_used, rowid)) of unpinned, unleased files used after `after`,
        least recently used first (the index on (pinned, last_used) skips every pinned file
        at once). Pass the last one's third item as `after` for the next page."""
        rows = db.execute("SELECT namespace, key, last_used, rowid FROM files f WHERE pinned = 0 AND "
                          "(last_used, rowid) > (?, ?) AND NOT EXISTS (SELECT 1 FROM leases l WHERE "
                          "l.namespace = f.namespace AND l.key = f.key) ORDER BY last_used, rowid LIMIT ?",
                          (*after, limit)).fetchall()
        return [(ns, key, (used, rowid)) for ns, key, used, rowid in rows]

    def deletable(self, db: sqlite3.Connection, ns: str, key: str) -> bool:
        """Neither pinned by a name nor leased by a reader (inside a transaction)."""
        return not (db.execute("SELECT 1 FROM pins WHERE namespace=? AND key=?", (ns, key)).fetchone()
                    or db.execute("SELECT 1 FROM leases WHERE namespace=? AND key=?", (ns, key)).fetchone())

    def touch(self, ns: str, key: str) -> None:
        """A use of the file: recorded by the keeper, or by this process's next write that
        looks at recency (`apply_touches`); never a write on the caller's thread."""
        self._touches[(ns, key)] = time.time()

    def touched(self) -> bool:
        return bool(self._touches)

    def apply_touches(self, db: sqlite3.Connection) -> bool:
        """Record this process's pending uses of files (inside a transaction)."""
        touches, self._touches = self._touches, {}
        db.executemany("UPDATE files SET last_used=MAX(last_used, ?) WHERE namespace=? AND key=?",
                       [(t, ns, key) for (ns, key), t in touches.items()])
        return bool(touches)

    def total_bytes(self, db: sqlite3.Connection | None = None) -> int:
        """Unique bytes on disk: every file once, every block once (kept by triggers)."""
        sql = "SELECT COALESCE(SUM(v), 0) FROM totals WHERE k IN ('file_bytes', 'block_bytes')"
        return (db.execute(sql).fetchone() if db is not None else self.query(sql)[0])[0]

    def changes(self) -> tuple[list[FileRow], list[tuple], bool]:
        """Files added and (namespace, key) removed since the last call, in one read (each added
        file's current row with it); reload=True when this process fell behind the pruned log
        and must reload every row."""
        rows = self.query(f"SELECT c.seq, c.op, c.namespace, c.key, {_JOINED} FROM changes c LEFT JOIN files f "
                          "ON f.namespace = c.namespace AND f.key = c.key WHERE c.seq > ? ORDER BY c.seq", (self.seq,))
        if not rows:
            return [], [], False
        last = {(r[2], r[3]): r for r in rows}
        # fell behind the pruned log, or so much changed that one full read is cheaper
        reload = (rows[0][0] > self.seq + 1 and self.seq > 0) or len(last) > 256
        self.seq = rows[-1][0]
        if reload:
            return [], [], True
        added = [self._file_row(r[4:]) for r in last.values() if r[1] == "add" and r[4] is not None]
        return added, [k for k, r in last.items() if r[1] == "del" or r[4] is None], False

    def _max_seq(self) -> int:
        return self.query("SELECT COALESCE(MAX(seq), 0) FROM changes")[0][0]

    # --- blocks (format 2) ---

    def reserve_blocks(self, names: list[str], write_id: int) -> tuple[set, set]:
        """Claim the blocks a write will reference (no process frees them meanwhile); returns
        (those not recorded as present, those being freed right now: write them once that ends)."""
        names = set(names)
        with self.transaction("reserve") as db:
            db.executemany("INSERT INTO claims VALUES(?,?,?)", [(n, self.owner, write_id) for n in names])
            present = {n for n in names if db.execute("SELECT 1 FROM blocks WHERE name=?", (n,)).fetchone()}
            freeing = {n for n in names - present if db.execute("SELECT 1 FROM freeing WHERE name=?", (n,)).fetchone()}
        return names - present, freeing

    def being_freed(self, names: Iterable[str]) -> dict:
        """Those of `names` marked `freeing` -> the owner of the mark (`describe(owner)` says who)."""
        return {n: r[0][0] for n in names if (r := self.query("SELECT owner FROM freeing WHERE name=?", (n,)))}

    def add_blocks(self, sizes: dict[str, int], db: sqlite3.Connection | None = None) -> None:
        """Record blocks durable on disk (in the caller's transaction when given), except those
        another process is unlinking (`freeing`): a row for one would outlive its file."""
        if db is None:
            with self.transaction("record") as db:
                return self.add_blocks(sizes, db)
        now = time.time()
        db.executemany("INSERT OR IGNORE INTO blocks SELECT ?, ?, ? WHERE NOT EXISTS "
                       "(SELECT 1 FROM freeing WHERE name=?)", [(n, b, now, n) for n, b in sizes.items()])

    def claims_held(self, db: sqlite3.Connection, write_id: int, names: Iterable[str]) -> bool:
        """Whether this write still claims every one of `names` and each is recorded on disk:
        what a commit checks before it renames (a write declared dead lost its claims)."""
        held = db.execute("SELECT COUNT(DISTINCT c.block) FROM claims c JOIN blocks b ON b.name = c.block "
                          "WHERE c.owner=? AND c.write_id=?", (self.owner, write_id)).fetchone()[0]
        return held == len(set(names))

    def release(self, db: sqlite3.Connection, write_id: int) -> list[str]:
        """End a write's (or, with -lease id, a read's) claims; returns the blocks they named."""
        return [r[0] for r in db.execute("DELETE FROM claims WHERE owner=? AND write_id=? RETURNING block",
                                         (self.owner, write_id))]

    def free_blocks(self, db: sqlite3.Connection, names: Iterable[str]) -> list[tuple[str, int]]:
        """Drop the rows of the blocks among `names` that no file references and no one
        claims, and mark them `freeing`; returns (name, bytes) of each: the caller unlinks
        them after COMMIT, then calls `unfree`."""
        out = []
        for n in sorted(set(names)):
            row = db.execute("DELETE FROM blocks WHERE name=? AND NOT EXISTS (SELECT 1 FROM refs WHERE block=?) "
                             "AND NOT EXISTS (SELECT 1 FROM claims WHERE block=?) RETURNING bytes", (n, n, n)).fetchone()
            if row is not None:
                db.execute("INSERT OR REPLACE INTO freeing VALUES(?, ?)", (n, self.owner))
                out.append((n, row[0]))
        return out

    def unfree(self, names: list[str]) -> None:
        """Their files are unlinked: the blocks may be written again."""
        if names:
            with self.transaction("unfree") as db:
                db.executemany("DELETE FROM freeing WHERE name=? AND owner=?", [(n, self.owner) for n in names])

    def own_freeing(self, db: sqlite3.Connection, names: Iterable[str]) -> set:
        """Those of `names` still marked `freeing` by us and recorded by no row: the fence before
        an unlink or a move (cache/ssd/removal.py). A mark a sweep took over is not ours any more."""
        return {n for n in names if db.execute("SELECT 1 FROM freeing f WHERE name=? AND owner=? AND NOT EXISTS "
                                               "(SELECT 1 FROM blocks WHERE name=f.name)", (n, self.owner)).fetchone()}

    def indexed(self, paths: Iterable[Path]) -> set:
        """Those of these manifest paths (<ns>/<key>.<tag>.ckpt) a row points at (a read)."""
        return {p for p in paths if (r := self.query("SELECT path FROM files WHERE namespace=? AND key=?", (
            p.parent.name, p.name.split(".")[0]))) and self.root / r[0][0] == p}

    def drop_block(self, db: sqlite3.Connection, name: str, freeing: bool) -> list[tuple]:
        """Forget a block found bad or gone, claimed or not; with `freeing` (its bad file goes
        after COMMIT, then `unfree`) no one writes it again meanwhile. Returns (namespace, key)
        of the files using it."""
        db.execute("DELETE FROM blocks WHERE name=?", (name,))
        if freeing:
            db.execute("INSERT OR REPLACE INTO freeing VALUES(?, ?)", (name, self.owner))
        return db.execute("SELECT namespace, key FROM refs WHERE block=?", (name,)).fetchall()

    def blocks(self) -> dict[str, int]:
        return dict(self.query("SELECT name, bytes FROM blocks"))

    def block_totals(self) -> tuple[int, int]:
        """(blocks, bytes) recorded (kept by triggers: cheap enough for stats read often)."""
        got = dict(self.query("SELECT k, v FROM totals WHERE k IN ('blocks', 'block_bytes')"))
        return got.get("blocks", 0), got.get("block_bytes", 0)

    def unreferenced_blocks(self, ignoring: Iterable[str] = ()) -> list[str]:
        """Blocks no file references and no one claims but the `ignoring` owners (a read: gc
        re-checks each in `free_blocks`; a dry run ignores the claims of the dead)."""
        ignoring = list(ignoring)
        return [r[0] for r in self.query(
            "SELECT name FROM blocks b WHERE NOT EXISTS (SELECT 1 FROM refs WHERE block=b.name) AND NOT EXISTS "
            f"(SELECT 1 FROM claims WHERE block=b.name AND owner NOT IN ({','.join('?' * len(ignoring))}))",
            tuple(ignoring))]

    def files_missing_blocks(self) -> list[tuple]:
        """(namespace, key) of files that reference a block with no row (a read)."""
        return self.query("SELECT DISTINCT namespace, key FROM refs r WHERE NOT EXISTS "
                          "(SELECT 1 FROM blocks WHERE name=r.block)")

    # --- pins, leases ---

    def set_pin(self, name: str, ns: str | None, key: str | None) -> None:
        with self.transaction("pin") as db:
            if ns is None:
                db.execute("DELETE FROM pins WHERE name=?", (name,))
            else:
                db.execute("INSERT OR REPLACE INTO pins VALUES(?,?,?)", (name, ns, key))

    def replace_pins(self, want: dict[str, tuple]) -> None:
        """Make the pins exactly `want` (name -> (namespace, key)), in one transaction."""
        with self.transaction("pin") as db:
            db.execute("DELETE FROM pins")
            db.executemany("INSERT INTO pins VALUES(?,?,?)", [(n, ns, key) for n, (ns, key) in want.items()])

    def pins(self) -> dict:
        return {name: (ns, key) for name, ns, key in self.query("SELECT name, namespace, key FROM pins")}

    def lease(self, ns: str, key: str) -> tuple[int, str, int] | None:
        """Keep (ns, key)'s file and every block it references until `end_lease`: returns
        (lease id, the file's path, how many of its blocks have no row), or None without a file."""
        with self.transaction("lease") as db:
            row = db.execute("SELECT path FROM files WHERE namespace=? AND key=?", (ns, key)).fetchone()
            if row is None:
                return None
            lid = db.execute("INSERT INTO leases(owner, namespace, key) VALUES(?,?,?)", (self.owner, ns, key)).lastrowid
            db.execute("INSERT INTO claims SELECT block, ?, ? FROM refs WHERE namespace=? AND key=?",
                       (self.owner, -lid, ns, key))
            missing = db.execute("SELECT COUNT(*) FROM refs r WHERE namespace=? AND key=? AND NOT EXISTS "
                                 "(SELECT 1 FROM blocks WHERE name=r.block)", (ns, key)).fetchone()[0]
        return lid, str(self.root / row[0]), missing

    def end_lease(self, db: sqlite3.Connection, lease_id: int) -> list[str]:
        """End a lease; returns the blocks it kept (candidates for `free_blocks`)."""
        db.execute("DELETE FROM leases WHERE id=? AND owner=?", (lease_id, self.owner))
        return self.release(db, -lease_id)

    # --- in-flight records ---

    def inflight_put(self, request: str, record: dict) -> None:
        with self.transaction("inflight") as db:
            db.execute("INSERT OR REPLACE INTO inflight VALUES(?,?,?,?,?,?)",
                       (request, json.dumps(record), time.time(), self.owner, record.get("namespace", ""),
                        record.get("boundary_key", "")))

    def inflight_get(self, request: str) -> dict | None:
        rows = self.query("SELECT record FROM inflight WHERE request=?", (request,))
        return json.loads(rows[0][0]) if rows else None

    def inflight_delete(self, request: str) -> None:
        with self.transaction("inflight") as db:
            db.execute("DELETE FROM inflight WHERE request=?", (request,))

    def inflight_all(self) -> list[dict]:
        return [json.loads(r[0]) for r in self.query("SELECT record FROM inflight")]

    # --- dead processes ---

    def sweep(self) -> tuple[list[tuple[str, int]], bool]:
        """Forget dead processes: their rows, claims and leases, and the resume records
        of their requests whose boundary file is gone. Returns the blocks their claims
        kept that nothing holds now (unlink them, then `unfree`), and whether anyone
        died (then their temp files may go)."""
        dead, orphans = self.dead_owners()
        stale = self.query("SELECT 1 FROM inflight i WHERE owner NOT IN (SELECT owner FROM procs) AND NOT EXISTS "
                           "(SELECT 1 FROM files f WHERE f.namespace=i.namespace AND f.key=i.key) LIMIT 1")
        if not (dead or orphans or stale):
            return [], False
        with self.transaction("sweep") as db:
            names, unlink = [], []
            for owner in dead + orphans:
                db.execute("DELETE FROM procs WHERE owner=?", (owner,))
                names += [r[0] for r in db.execute("DELETE FROM claims WHERE owner=? RETURNING block", (owner,))]
                db.execute("DELETE FROM leases WHERE owner=?", (owner,))
                unlink += [(r[0], 0) for r in db.execute("UPDATE freeing SET owner=? WHERE owner=? RETURNING name",
                                                         (self.owner, owner))]  # its unlinks may not have happened
            db.execute("DELETE FROM inflight WHERE owner NOT IN (SELECT owner FROM procs) AND NOT EXISTS "
                       "(SELECT 1 FROM files f WHERE f.namespace=inflight.namespace AND f.key=inflight.key)")
            freed = self.free_blocks(db, names)
        self.forget_owners(dead + orphans)
        return freed + unlink, bool(dead or orphans)
