"""Who is alive among the processes sharing a cache directory.

Every open catalogue registers a row (tables.py, table `procs`) with its
owner id, its process tag (carried by its temp files, system.process_tag),
pid, host name, kernel boot id, PID namespace and process start time; and
it beats a heartbeat: a counter in `<root>/.heartbeats/<owner>`, bumped
every HEARTBEAT_S by a thread that does nothing else. The heartbeat lives
outside SQLite, so a process that holds the catalogue's write lock for a
minute stalls nobody's heartbeat.

A peer is judged
- on the same kernel boot and in the same PID namespace (Linux, /proc
  agreeing with our pid; macOS, one boot): by its pid and start time as
  psutil reads them, at once (a reused pid has another start time; a
  zombie is dead; a stopped process is alive);
- otherwise (another container's PID namespace, another boot id): by its heartbeat,
  dead only after MISSES observations of an unchanged counter, each at
  least HEARTBEAT_S after the previous on our monotonic clock, spanning at
  least DEAD_AFTER_S. Never by the age of a claim and never by a wall
  clock: a clock that jumps (or a test's injected one) counts one miss.

A process on another host can only share the directory over a network
filesystem, which the store refuses (system.unsupported_filesystem).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from ...host import safe_dirs

HEARTBEAT_S = 1.0
DEAD_AFTER_S = 30.0
MISSES = 5


# The start time as the procs table stores it: on Linux clock ticks since boot, on macOS
# microseconds since the epoch (the kernel's p_starttime). Both are fixed for the life of the
# process: no later change of the wall clock moves them.
_START_UNITS = 1_000_000 if sys.platform == "darwin" else os.sysconf("SC_CLK_TCK")
_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)  # killed and not yet reaped: gone
STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)  # alive, doing nothing until resumed


def process_start(pid: int | str) -> int | None:
    """When the process started (see _START_UNITS); None when it is gone or where psutil
    does not say.

    The start is psutil's own identity of a process (Process._ident: the pid and the
    monotonic start time it checks pid reuse with). Its public create_time() is not it: that
    is the boot time plus the start, the boot time read from the wall clock again at each
    call (Linux) or shifted by the clock changes since psutil was imported (macOS), so two
    processes could disagree about one peer and take it for another. The state is read just
    after the start: a pid reused in between makes a dead process look alive until the next
    look, never a live one dead."""
    try:
        p = psutil.Process(None if pid == "self" else int(pid))
        if p.status() in _GONE:
            return None
        seconds = p._ident[1]
    except (psutil.Error, ValueError):
        return None
    return round(seconds * _START_UNITS) if isinstance(seconds, float) else None


def process_state(pid: int) -> str | None:
    """psutil's status of `pid` (one of STOPPED for SIGSTOP, Ctrl-Z or a debugger's stop;
    psutil.STATUS_RUNNING, ...); None when it is gone (a zombie too) or unreadable."""
    try:
        state = psutil.Process(pid).status()
    except psutil.Error:
        return None
    return None if state in _GONE else state


def _boot_id() -> str:
    """This boot, the same in every process on it. Linux: the kernel's boot UUID, not
    psutil.boot_time(): that is the wall clock less the uptime, read again at each call, so
    a clock step between two processes' starts would give one boot two ids, and pids would
    not be checked between them (heartbeats only: a SIGSTOPped peer looks dead after
    DEAD_AFTER_S). macOS has no boot UUID in psutil: kern.boottime's seconds
    (psutil.boot_time(), as stored before), which a clock step moves too."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return f"darwin-{int(psutil.boot_time())}"
        except (psutil.Error, OSError):
            pass
    return ""


def _pid_namespace() -> str:
    """Our PID namespace, "" when /proc does not show our own pids (then pids are not checked)."""
    if sys.platform == "darwin":
        return "darwin"
    try:
        if os.readlink("/proc/self") != str(os.getpid()):  # /proc of another namespace (unshare without --mount-proc)
            return ""
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@dataclass(frozen=True)
class Identity:
    """What tells this process apart from every other one sharing the directory."""

    pid: int
    host: str
    boot: str  # "" where unknown
    pidns: str  # "" where pids cannot be checked
    start: int | None

    @classmethod
    def current(cls) -> "Identity":
        """This process. MLXCACHE_BOOT_ID stands in for the kernel's boot id (tests: another machine)."""
        return cls(os.getpid(), socket.gethostname(), os.environ.get("MLXCACHE_BOOT_ID") or _boot_id(),
                   _pid_namespace(), process_start("self"))

    def same_pids(self, row: dict) -> bool:
        """Whether our pids mean the same processes as the row's (one boot, one PID namespace)."""
        return bool(self.boot and self.pidns) and row["boot"] == self.boot and row["pidns"] == self.pidns


class Heart:
    """This catalogue's heartbeat: a counter in a file, bumped every HEARTBEAT_S by a thread
    of its own (so no slow disk or catalogue work delays it)."""

    def __init__(self, directory: Path, owner: str, anchor: Path | None = None):
        """anchor: below it no link is followed (host/safe_dirs.py; default: directory's parent)."""
        self.anchor = directory.parent if anchor is None else anchor
        self.path = directory / owner
        self.count = 0
        self._fd = self._create()
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="catalog-heartbeat", daemon=True)
        self._thread.start()

    def _create(self) -> int:
        with safe_dirs.Dir(self.path.parent, self.anchor, create=True) as d:
            return d.open(self.path.name, os.O_RDWR | os.O_CREAT)

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.beat()

    def beat(self) -> None:
        self.count += 1
        try:
            if not safe_dirs.exists(self.path, self.anchor):  # removed by a peer that took us for dead: back again
                fd, self._fd = self._fd, self._create()
                os.close(fd)
        except OSError:
            pass  # (its directory a link now: reported; the counter goes on in our file)
        try:
            os.pwrite(self._fd, struct.pack("<Q", self.count), 0)
        except OSError:
            pass  # a full or failing disk: peers in our PID namespace still see our pid

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            os.close(self._fd)
        except OSError:
            pass
        safe_dirs.unlink(self.path, self.anchor)


def read_beat(directory: Path, owner: str) -> int | None:
    try:
        with open(directory / owner, "rb") as f:
            return struct.unpack("<Q", f.read(8))[0]
    except (OSError, struct.error):
        return None


class Peers:
    """This process's verdicts on the others, from their rows and what it saw of their heartbeats."""

    def __init__(self, me: Identity, owner: str, beats: Path, clock: Callable[[], float] = time.monotonic):
        self.me, self.owner, self.beats, self.clock = me, owner, beats, clock
        self._seen: dict[str, list] = {}  # owner -> [beat, last change, misses, last counted miss]
        self._lock = threading.Lock()

    def alive(self, row: dict) -> bool:
        if row["owner"] == self.owner:
            return True
        if self.me.same_pids(row):
            if row["start"] is not None and self.me.start is not None:
                return process_start(row["pid"]) == row["start"]
            if not psutil.pid_exists(row["pid"]):
                return False
        return self.beating(row["owner"])

    def beating(self, owner: str) -> bool:
        """Judged by its heartbeat alone: not (yet) seen to stop."""
        return not self._missed(owner)

    def _missed(self, owner: str) -> bool:
        beat, now = read_beat(self.beats, owner), self.clock()
        with self._lock:
            seen = self._seen.get(owner)
            if seen is None or (beat is not None and beat != seen[0]):
                self._seen[owner] = [beat, now, 0, now]
                return False
            if now - seen[3] >= HEARTBEAT_S:
                seen[2] += 1
                seen[3] = now
            return seen[2] >= MISSES and now - seen[1] >= DEAD_AFTER_S

    def forget(self, owner: str) -> None:
        with self._lock:
            self._seen.pop(owner, None)


class Keeper:
    """The background thread of an open catalogue: every HEARTBEAT_S it runs `work()`
    (deferred catalogue writes, the sweep of dead peers); a failure waits for the next turn."""

    def __init__(self, work: Callable[[], None]):
        self.work = work
        self.error: str | None = None  # the last failure of work()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="catalog-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from .database import KEEPER_WAIT_S, background_thread

        background_thread(KEEPER_WAIT_S)
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.work()
                self.error = None
            except Exception as exc:  # the keeper must outlive any one failure
                self.error = f"{type(exc).__name__}: {exc}"

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(10)
