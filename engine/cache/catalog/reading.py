"""Reading a cache directory's catalogue from outside the engine (the JupyterLab panel's
server): a read-only SQLite connection that registers no process, takes no lock a writer
waits for, and never waits long itself.

- `mode=ro`: SQLite refuses every write on it; in WAL mode a read does not wait for
  writers. One read transaction per snapshot, so its numbers agree with each other; when no
  connection committed since the last snapshot of the same page (`PRAGMA data_version`), the
  last one is the answer (a quiet directory costs a refresh almost nothing).
- Busy (a checkpoint resetting the WAL, a process holding the database in exclusive
  locking mode) is ReadBusy after READ_WAIT_S: the caller says so and asks again.
- A damaged file is ReadCorrupt: left alone (the next engine to open it sets it aside
  and rebuilds it from the files, database.py).
- A catalogue from before schema 4 has no `writers` table (its files have no writer) and no
  `files_view` index (its scans read whole rows: slower, the same answers).

The writes the panel asks for go through the engine's own catalogue (tables.py), never here.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from pathlib import Path
from urllib.parse import quote
from ...errors import ReadBusy, ReadCorrupt  # noqa: F401 (raised here; defined in errors.py)


READ_WAIT_S = 0.1
PAGE_MAX = 500
SORTS = {"last_used": "f.last_used", "created": "f.created", "tokens": "f.length", "kv": "f.kv_bytes",
         "bytes": "(f.file_bytes + f.block_bytes)", "pinned": "f.pinned", "writer": "w.pid"}
_BUSY, _LOCKED, _CORRUPT, _NOTADB = 5, 6, 11, 26


def escaped(text: str) -> str:
    """`text` for a LIKE pattern with ESCAPE '\\': its own % and _ match only themselves."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def check_page(sort: str, pinned: str) -> None:
    """ValueError (one line) for a sort or a pinned filter `snapshot` does not know."""
    if sort not in SORTS:
        raise ValueError(f"unknown sort {sort!r}; use one of {', '.join(SORTS)}")
    if pinned not in ("all", "pinned", "unpinned"):
        raise ValueError(f"pinned must be all, pinned or unpinned, not {pinned!r}")



def _mapped(exc: sqlite3.Error, path: Path) -> Exception:
    code = (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF
    if code in (_BUSY, _LOCKED):
        return ReadBusy(f"the catalogue {path} is busy ({exc}); asking again")
    if code in (_CORRUPT, _NOTADB):
        return ReadCorrupt(f"the catalogue {path} is damaged ({exc})")
    return exc


class CatalogReader:
    """Snapshots of one catalogue file; any thread (one connection each)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._local = threading.local()

    def _connection(self) -> sqlite3.Connection:
        inode = os.stat(self.path).st_ino  # FileNotFoundError: the caller's state "no catalogue yet"
        c = getattr(self._local, "conn", None)
        if c is not None and self._local.inode == inode:
            return c
        self._local.last = None
        if c is not None:
            c.close()
        c = sqlite3.connect(f"file:{quote(str(self.path))}?mode=ro", uri=True, timeout=READ_WAIT_S,
                            isolation_level=None, check_same_thread=False)
        self._local.conn, self._local.inode = c, inode
        return c

    def snapshot(self, namespace: str | None = None, *, prefix: str | None = None, sort: str = "last_used",
                 descending: bool = True,
                 query: str = "", pinned: str = "all", limit: int = 50, offset: int = 0) -> dict:
        """Everything the panel shows, read in one transaction: processes, totals, namespaces,
        per-owner activity, pins, and one page of files (of `namespace`, of the namespaces
        starting with `prefix`, or of every one)
        sorted by `sort` and filtered by `query` (a key prefix, a pin name, a writer's pid or
        host) and `pinned` ("all", "pinned", "unpinned")."""
        check_page(sort, pinned)
        limit, offset = max(1, min(int(limit), PAGE_MAX)), max(0, int(offset))
        args = (namespace, prefix, sort, bool(descending), query, pinned, limit, offset)
        try:
            db = self._connection()
            db.execute("BEGIN")
            try:
                # nothing committed since the last read of the same page: the same answer
                version = db.execute("PRAGMA data_version").fetchone()[0]
                last = getattr(self._local, "last", None)
                if last is not None and last[:2] == (version, args):
                    return last[2]
                read = self._read(db, *args)
                self._local.last = (version, args, read)
                return read
            finally:
                db.execute("COMMIT")
        except sqlite3.Error as e:
            self._forget()
            raise _mapped(e, self.path) from e

    def _forget(self) -> None:
        c = getattr(self._local, "conn", None)
        self._local.last = None
        if c is not None:
            self._local.conn = None
            try:
                c.close()
            except sqlite3.Error:
                pass

    def _read(self, db, namespace, prefix, sort, descending, query, pinned, limit, offset) -> dict:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "files" not in tables:  # created, its schema not committed yet
            raise ReadBusy(f"the catalogue {self.path} is being created; asking again")
        writers = "writers" in tables
        indexed = "INDEXED BY files_view" if db.execute(
            "SELECT 1 FROM sqlite_master WHERE type='index' AND name='files_view'").fetchone() else ""
        version = db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()
        totals = dict(db.execute("SELECT k, v FROM totals").fetchall())
        procs = [dict(zip(("owner", "tag", "pid", "host", "boot", "pidns", "start", "started", "pending_writes",
                           "pending_bytes"), r)) for r in db.execute(
            "SELECT owner, tag, pid, host, boot, pidns, start, started, pending_writes, pending_bytes FROM procs")]
        namespaces = [dict(zip(("namespace", "files", "tokens", "bytes", "kv_bytes", "pinned", "last_used"), r))
                      for r in db.execute("SELECT namespace, COUNT(*), SUM(length), SUM(file_bytes + block_bytes), "
                                          f"SUM(kv_bytes), SUM(pinned > 0), MAX(last_used) FROM files {indexed} "
                                          "GROUP BY namespace ORDER BY namespace")]
        activity: dict = {}

        def add(sql: str, *fields: str) -> None:
            for owner, *values in db.execute(sql):
                activity.setdefault(owner, {}).update(zip(fields, values))

        add("SELECT owner, COUNT(DISTINCT write_id) FROM claims WHERE write_id > 0 GROUP BY owner", "writing")
        add("SELECT owner, COUNT(*) FROM leases GROUP BY owner", "reading")
        add("SELECT owner, COUNT(*) FROM inflight WHERE owner != '' GROUP BY owner", "resume_records")
        if writers:  # (a writer's row goes with its file: a trigger)
            add("SELECT owner, COUNT(*), SUM(bytes), MAX(pid), MAX(host) FROM writers GROUP BY owner",
                "files", "bytes", "pid", "host")
        where, args = self._filter(namespace, prefix, query, pinned, writers)
        join = "LEFT JOIN writers w ON w.namespace = f.namespace AND w.key = f.key" if writers else \
            "LEFT JOIN (SELECT NULL AS owner, NULL AS pid, NULL AS host, NULL AS time) w ON 0"
        select_join = join if (query or "").strip() or sort == "writer" else ""  # the page's rowids need it?
        matching = db.execute(f"SELECT COUNT(*) FROM files f {indexed} {select_join} WHERE {where}", args).fetchone()[0]
        order = f"{SORTS[sort]} {'DESC' if descending else 'ASC'}, f.rowid"
        # the page's rowids first, from the index alone (files_view); then only those rows
        rows = db.execute(
            "SELECT f.namespace, f.key, f.length, f.file_bytes, f.block_bytes, f.kv_bytes, f.created, f.last_used, "
            "f.format_version, f.pinned, w.owner, w.pid, w.host, w.time, "
            "(SELECT group_concat(p.name, '\n') FROM pins p WHERE p.namespace = f.namespace AND p.key = f.key), "
            "(SELECT COUNT(*) FROM leases l WHERE l.namespace = f.namespace AND l.key = f.key) "
            f"FROM (SELECT f.rowid AS id, {SORTS[sort]} AS o FROM files f {indexed} {select_join} WHERE {where} "
            f"ORDER BY {order} LIMIT ? OFFSET ?) page JOIN files f ON f.rowid = page.id {join} "
            f"ORDER BY page.o {'DESC' if descending else 'ASC'}, f.rowid", (*args, limit, offset)).fetchall()
        files = [{"namespace": r[0], "key": r[1], "tokens": r[2], "bytes": r[3] + r[4], "file_bytes": r[3],
                  "block_bytes": r[4], "kv_bytes": r[5], "created": r[6], "last_used": r[7], "format": r[8],
                  "pinned_by": sorted(r[14].split("\n")) if r[14] else [], "leases": r[15],
                  "writer": {"owner": r[10], "pid": r[11], "host": r[12], "time": r[13]} if r[10] else None}
                 for r in rows]
        return {"schema": int(version[0]) if version else None, "totals": totals, "processes": procs,
                "namespaces": namespaces, "activity": activity, "pins": db.execute(
                    "SELECT name, namespace, key FROM pins ORDER BY name").fetchall(),
                "page": {"namespace": namespace, "prefix": prefix, "sort": sort, "descending": descending, "query": query,
                         "pinned": pinned, "offset": offset, "limit": limit, "matching": matching, "files": files}}

    @staticmethod
    def _filter(namespace, prefix, query: str, pinned: str, writers: bool) -> tuple[str, tuple]:
        where, args = ["1"], []
        if namespace is not None:
            where.append("f.namespace = ?")
            args.append(namespace)
        if prefix is not None:
            where.append("f.namespace LIKE ? ESCAPE '\\'")
            args.append(escaped(prefix) + "%")
        if pinned != "all":
            where.append("f.pinned > 0" if pinned == "pinned" else "f.pinned = 0")
        query = (query or "").strip()
        if query:
            alts = ["f.key LIKE ? ESCAPE '\\'", "EXISTS (SELECT 1 FROM pins p WHERE p.namespace = f.namespace AND "
                    "p.key = f.key AND p.name LIKE ? ESCAPE '\\')"]
            if writers:
                alts += ["CAST(w.pid AS TEXT) = ?", "w.host LIKE ? ESCAPE '\\'"]
            where.append("(" + " OR ".join(alts) + ")")
            args += [escaped(query.lower()) + "%", "%" + escaped(query) + "%"] + ([query, "%" + escaped(query) + "%"]
                                                                              if writers else [])
        return " AND ".join(where), tuple(args)

    def close(self) -> None:
        self._forget()
