"""Power loss for the fault harness, in the spirit of ALICE (OSDI 2014) and lazyfs: record what
a worker made durable, then rebuild the cache directory as a power cut at any moment would
leave it (tests/engine/cache/test_power_loss.py).

Recording (`install(root, out)`, in the worker process only, before its store opens) wraps
`os.fsync`/`os.fdatasync` (every fsync of the engine goes through them on Linux:
system.fsync_file, fsync_dir) and the calls that can free an inode (`os.unlink`, `os.remove`,
`os.replace`, `os.rename`), and observes every fault point (faults.observe). It writes
`out/events.jsonl` and the durable contents of files under `out/blobs/`:

    init     the directory at the start: every listing and every file's bytes (durable:
             the template was written by a process that closed cleanly)
    file     an fsync of a regular file: its bytes at that moment are durable
    dir      an fsync of a directory: its listing at that moment is durable (new names,
             renames into it, and removals from it)
    commit   a catalogue transaction committed (a snapshot of the committed database,
             taken at "<label>.committed" through a reader connection); `full` when the
             committing connection ran with PRAGMA synchronous=FULL or EXTRA
    synced   the WAL was synced: Database.checkpoint() returned, or the store closed (SQLite
             checkpoints when the last connection closes)
    presync  an fsync is about to run: every listing of the tree (for the eager model)
    ack      the worker acknowledged its operation (fault_worker.py)
    point    a fault point was reached (names the crash points in messages), with every
             listing of the tree at that moment (for the eager model below)

The model of durability (the pessimistic one POSIX allows; what ext4, xfs and btrfs may do
on a power cut):
- A file's bytes are those of its last fsync (a file never fsynced is empty; a file of the
  starting directory keeps its starting bytes until an fsync).
- A directory's entries are those of its last fsync (its starting listing before one): a
  name created, renamed in or removed since then is not on the disk. A rename is durable in
  the destination at the destination's fsync and gone from the source at the source's fsync.
- Files are inodes: a name keeps pointing at the inode it pointed at when its directory was
  fsynced; an inode number freed by an unlink or a replace and used again is a new file.
- SQLite's files (catalog.db, -wal, -shm, -journal) are not modelled byte by byte: SQLite
  writes them itself. We assume what SQLite documents for WAL mode: a transaction is
  durable when its COMMIT returns if the connection ran synchronous=FULL (or EXTRA: the WAL
  is fsynced at each commit); with synchronous=NORMAL only once the WAL was synced (before
  every checkpoint, and by the checkpoint of the last connection's close), and a power cut
  may roll back any suffix of the commits made since (WAL frames carry cumulative checksums:
  recovery keeps a prefix of the transactions). The -shm is rebuilt at open. So the
  catalogue after a cut at event k is any committed snapshot from the last durable one to
  the last one committed before k.

`crash_states(out, eager=True)` is a second model, ext4's data=writeback: every name
operation up to the cut reached the disk (as a journal commits metadata), file bytes only
those fsynced. It catches a rename before the data's fsync, which the first model cannot
tell from a rename after it.

Linux only (the fd is read back through /proc/self/fd; macOS syncs with F_FULLFSYNC, not
os.fsync).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import blake3

CATALOGUE = ("catalog.db", "catalog.db-wal", "catalog.db-shm", "catalog.db-journal")


class Recorder:
    def __init__(self, root: Path, out: Path):
        self.root, self.out = Path(os.path.realpath(root)), Path(out)
        (self.out / "blobs").mkdir(parents=True, exist_ok=True)
        (self.out / "db").mkdir(exist_ok=True)
        self._lock = threading.RLock()
        self._log = open(self.out / "events.jsonl", "a")
        self._gen: dict[int, int] = {}  # inode -> how many times it was freed (its incarnation)
        self._full = threading.local()
        self.versions = 0
        self.real = {n: getattr(os, n) for n in ("fsync", "fdatasync", "unlink", "remove", "replace", "rename")}

    # --- what is written ---

    def _emit(self, event: dict) -> None:
        with self._lock:
            self._log.write(json.dumps(event) + "\n")
            self._log.flush()

    def _blob(self, data: bytes) -> str:
        name = blake3.blake3(data).hexdigest()
        path = self.out / "blobs" / name
        if not path.exists():
            path.write_bytes(data)
        return name

    def _id(self, st: os.stat_result) -> list:
        return [st.st_ino, self._gen.get(st.st_ino, 0)]

    def _rel(self, path: str) -> str | None:
        p = Path(os.path.realpath(path))
        if p != self.root and self.root not in p.parents:
            return None
        return str(p.relative_to(self.root)) if p != self.root else ""

    def _listing(self, d: Path, top: bool) -> dict:
        out = {}
        for e in os.scandir(d):
            if top and e.name in CATALOGUE:
                continue
            st = e.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                out[e.name] = ["d"]
            elif stat.S_ISREG(st.st_mode):
                out[e.name] = ["f", *self._id(st)]
        return out

    def _snapshot_db(self) -> None:
        db = self.root / "catalog.db"
        if not db.exists():
            return
        with self._lock:
            self.versions += 1
            dest = self.out / "db" / f"{self.versions}.db"
            src = sqlite3.connect(db, timeout=30)
            try:
                dst = sqlite3.connect(dest)
                src.backup(dst)
                dst.close()
            finally:
                src.close()
            return self.versions

    # --- the start ---

    def _tree(self) -> dict:
        out = {}
        for d, _, _ in os.walk(self.root):
            rel = self._rel(d)
            try:
                out[rel] = self._listing(Path(d), rel == "")
            except FileNotFoundError:
                pass
        return out

    def start(self) -> None:
        dirs, files = {}, {}
        for d, _, names in os.walk(self.root):
            rel = self._rel(d)
            dirs[rel] = self._listing(Path(d), rel == "")
            for name, entry in dirs[rel].items():
                if entry[0] == "f":
                    files[f"{entry[1]}:{entry[2]}"] = self._blob((Path(d) / name).read_bytes())
        self._emit({"e": "init", "dirs": dirs, "files": files, "v": self._snapshot_db()})

    # --- the wrapped calls ---

    def fsync(self, fd: int, real) -> None:
        self._emit({"e": "presync", "now": self._tree()})  # (a cut just before it, in the eager model)
        real(fd)
        st = os.fstat(fd)
        target = os.readlink(f"/proc/self/fd/{fd}")
        rel = self._rel(target.removesuffix(" (deleted)"))
        if rel is None:
            return
        if stat.S_ISDIR(st.st_mode):
            self._emit({"e": "dir", "path": rel, "entries": self._listing(self.root / rel, rel == "")})
        elif stat.S_ISREG(st.st_mode) and Path(rel).name not in CATALOGUE:
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                data = f.read()
            self._emit({"e": "file", "id": self._id(st), "blob": self._blob(data)})

    def freeing(self, path, dir_fd, call):
        """Run call(); if it removed the last name of a regular file at `path`, that inode is freed."""
        try:
            st = os.lstat(path, dir_fd=dir_fd)
        except OSError:
            st = None
        result = call()
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            with self._lock:
                self._gen[st.st_ino] = self._gen.get(st.st_ino, 0) + 1
        return result

    def point(self, name: str, db) -> None:
        if db is not None and name.endswith(".commit"):
            self._full.value = db.execute("PRAGMA synchronous").fetchone()[0] >= 2
        if name.endswith(".committed"):
            v = self._snapshot_db()
            self._emit({"e": "commit", "v": v, "full": bool(getattr(self._full, "value", False)), "at": name})
        else:
            self._emit({"e": "point", "name": name, "now": self._tree()})

    def synced(self) -> None:
        self._emit({"e": "synced"})

    def ack(self) -> None:
        self._emit({"e": "ack"})


def install(root, out) -> Recorder:
    """Record, in this process, what becomes durable under `root` (see the module's docstring)."""
    from mlxcache_kernel.engine.cache import faults
    from mlxcache_kernel.engine.cache.catalog.database import Database

    rec = Recorder(Path(root), Path(out))
    rec.start()
    real = rec.real
    os.fsync = lambda fd: rec.fsync(fd, real["fsync"])
    os.fdatasync = lambda fd: rec.fsync(fd, real["fdatasync"])
    os.unlink = lambda p, *, dir_fd=None: rec.freeing(p, dir_fd, lambda: real["unlink"](p, dir_fd=dir_fd))
    os.remove = lambda p, *, dir_fd=None: rec.freeing(p, dir_fd, lambda: real["remove"](p, dir_fd=dir_fd))
    os.replace = lambda a, b, *, src_dir_fd=None, dst_dir_fd=None: rec.freeing(
        b, dst_dir_fd, lambda: real["replace"](a, b, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd))
    os.rename = lambda a, b, *, src_dir_fd=None, dst_dir_fd=None: rec.freeing(
        b, dst_dir_fd, lambda: real["rename"](a, b, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd))
    faults.observe(rec.point)
    checkpoint, close = Database.checkpoint, Database.close

    def checkpointed(self) -> None:
        checkpoint(self)
        rec.synced()

    def closed(self) -> None:
        close(self)
        rec.synced()

    Database.checkpoint, Database.close = checkpointed, closed
    return rec


# --- after the cut ---------------------------------------------------------


@dataclass(frozen=True)
class CrashState:
    """The directory a power cut after `events` recorded events leaves, with catalogue `version`."""
    at: str  # the last fault point reached before the cut
    events: int
    dirs: tuple  # ((rel, ((name, entry), ...)), ...)
    files: tuple  # ((inode:gen, blob), ...)
    version: int | None
    acked: bool

    def build(self, out: Path, dest: Path) -> Path:
        """Write this state as a cache directory at `dest` (0700 directories, 0600 files)."""
        dirs, files = {k: dict(v) for k, v in self.dirs}, dict(self.files)

        def make(rel: str, path: Path) -> None:
            path.mkdir(mode=0o700)
            for name, entry in sorted(dirs.get(rel, {}).items()):
                child = f"{rel}/{name}" if rel else name
                if entry[0] == "d":
                    make(child, path / name)
                else:
                    blob = files.get(f"{entry[1]}:{entry[2]}")
                    (path / name).write_bytes(b"" if blob is None else (out / "blobs" / blob).read_bytes())
                    os.chmod(path / name, 0o600)

        make("", dest)
        if self.version is not None:
            shutil.copyfile(out / "db" / f"{self.version}.db", dest / "catalog.db")
            os.chmod(dest / "catalog.db", 0o600)
        return dest


def crash_states(out: Path, eager: bool = False) -> list[CrashState]:
    """Every distinct state a power cut between two recorded events (or after the last) leaves
    (eager: with every name operation up to there on the disk, see the module's docstring)."""
    events = [json.loads(line) for line in (Path(out) / "events.jsonl").read_text().splitlines()]
    init = events[0]
    assert init["e"] == "init", "the recording does not start with the directory's state"
    dirs = {k: tuple(sorted((n, tuple(e)) for n, e in v.items())) for k, v in init["dirs"].items()}
    files = dict(init["files"])
    durable = latest = init["v"]  # catalogue versions: the last durable one, the last committed
    acked, at = False, "start"
    seen, states = set(), []
    for i, ev in enumerate(events[1:] + [None], start=1):
        for v in range(durable, latest + 1) if latest is not None else [None]:
            key = (tuple(sorted(dirs.items())), tuple(sorted(files.items())), v, acked)
            if key not in seen:
                seen.add(key)
                states.append(CrashState(at, i, key[0], key[1], v, acked))
        if ev is None:
            break
        kind = ev["e"]
        if kind == "file":
            files[f"{ev['id'][0]}:{ev['id'][1]}"] = ev["blob"]
        elif kind == "dir" and not eager:
            dirs[ev["path"]] = tuple(sorted((n, tuple(e)) for n, e in ev["entries"].items()))
        elif kind == "commit":
            latest = ev["v"]
            if ev["full"]:
                durable = latest
            at = ev["at"]
        elif kind == "synced":
            durable = latest
        elif kind == "ack":
            acked = True
        elif kind == "presync" and eager:
            dirs = {k: tuple(sorted((n, tuple(e)) for n, e in v.items())) for k, v in ev["now"].items()}
        elif kind == "point":
            at = ev["name"]
            if eager:
                dirs = {k: tuple(sorted((n, tuple(e)) for n, e in v.items())) for k, v in ev["now"].items()}
    return states
