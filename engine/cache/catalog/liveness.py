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
  agreeing with our pid; macOS, one boot): by its pid and start time, at
  once (a reused pid has another start time; on macOS the start time comes
  from sysctl KERN_PROC_PID, see ExternProcHead);
- otherwise (another container's PID namespace, another boot id): by its heartbeat,
  dead only after MISSES observations of an unchanged counter, each at
  least HEARTBEAT_S after the previous on our monotonic clock, spanning at
  least DEAD_AFTER_S. Never by the age of a claim and never by a wall
  clock: a clock that jumps (or a test's injected one) counts one miss.

A process on another host can only share the directory over a network
filesystem, which the store refuses (system.unsupported_filesystem).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HEARTBEAT_S = 1.0
DEAD_AFTER_S = 30.0
MISSES = 5


def process_start(pid: int | str) -> int | None:
    """When the process started: on Linux in clock ticks since boot (/proc/<pid>/stat), on
    macOS in microseconds since the epoch (sysctl KERN_PROC_PID); None when it is gone (a
    zombie, killed and not yet reaped, is gone) or where the OS does not say."""
    if sys.platform == "darwin":
        return _darwin_start(os.getpid() if pid == "self" else int(pid))
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


class Timeval(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_int64), ("tv_usec", ctypes.c_int32)]  # (padded to 16 bytes)


class ExternProcHead(ctypes.Structure):
    """The start of macOS's `struct kinfo_proc` (<sys/sysctl.h>): its first member `kp_proc`, a
    `struct extern_proc` (<sys/proc.h>), whose first members on a 64-bit macOS are
        union p_un { struct { struct proc *__p_forw, *__p_back; } p_st1;
                     struct timeval __p_starttime; }          offset 0 (16 bytes)
        struct vmspace *p_vmspace                             offset 16
        struct sigacts *p_sigacts                             offset 24
        int p_flag                                            offset 32
        char p_stat                                           offset 36 (SZOMB = 5: a zombie)
        pid_t p_pid                                           offset 40
    The whole struct kinfo_proc is KINFO_PROC_SIZE (648) bytes."""

    _fields_ = [("p_starttime", Timeval), ("p_vmspace", ctypes.c_void_p), ("p_sigacts", ctypes.c_void_p),
                ("p_flag", ctypes.c_int32), ("p_stat", ctypes.c_char), ("p_pid", ctypes.c_int32)]


KINFO_PROC_SIZE = 648
_CTL_KERN, _KERN_PROC, _KERN_PROC_PID, _SZOMB = 1, 14, 1, 5


def parse_kinfo_proc(raw: bytes, pid: int) -> int | None:
    """The start time (microseconds since the epoch) in sysctl's answer for `pid`; None for an
    empty answer (no such process), another pid's or a zombie's."""
    if len(raw) < ctypes.sizeof(ExternProcHead):
        return None
    head = ExternProcHead.from_buffer_copy(raw[: ctypes.sizeof(ExternProcHead)])
    if head.p_pid != pid or head.p_stat == bytes([_SZOMB]):
        return None
    return head.p_starttime.tv_sec * 1_000_000 + head.p_starttime.tv_usec


def _darwin_start(pid: int) -> int | None:
    """sysctl({CTL_KERN, KERN_PROC, KERN_PROC_PID, pid}) into a struct kinfo_proc."""
    try:
        mib = (ctypes.c_int * 4)(_CTL_KERN, _KERN_PROC, _KERN_PROC_PID, pid)
        buf, size = ctypes.create_string_buffer(KINFO_PROC_SIZE), ctypes.c_size_t(KINFO_PROC_SIZE)
        if ctypes.CDLL(None, use_errno=True).sysctl(mib, 4, buf, ctypes.byref(size), None, ctypes.c_size_t(0)) != 0:
            return None
    except (OSError, AttributeError, ValueError):
        return None
    return parse_kinfo_proc(buf.raw[: size.value], pid)

def process_state(pid: int) -> str | None:
    """The state letter /proc shows for `pid` ("R", "S", "T" stopped, "t" stopped by a
    tracer, ...); None when it is gone or where /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        pass
    if sys.platform == "darwin":  # the boot time names this boot
        try:
            tv, size = (ctypes.c_int64 * 2)(), ctypes.c_size_t(16)  # struct timeval: the seconds come first
            if ctypes.CDLL(None).sysctlbyname(b"kern.boottime", tv, ctypes.byref(size), None, 0) == 0:
                return f"darwin-{tv[0]}"
        except (OSError, AttributeError):
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


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Heart:
    """This catalogue's heartbeat: a counter in a file, bumped every HEARTBEAT_S by a thread
    of its own (so no slow disk or catalogue work delays it)."""

    def __init__(self, directory: Path, owner: str):
        directory.mkdir(mode=0o700, exist_ok=True)
        self.path = directory / owner
        self.count = 0
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._stop = threading.Event()
        self.beat()
        self._thread = threading.Thread(target=self._run, name="catalog-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.beat()

    def beat(self) -> None:
        self.count += 1
        try:
            if not self.path.exists():  # removed by a peer that took us for dead: back again
                os.close(self._fd)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.pwrite(self._fd, struct.pack("<Q", self.count), 0)
        except OSError:
            pass  # a full or failing disk: peers in our PID namespace still see our pid

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            os.close(self._fd)
            os.unlink(self.path)
        except OSError:
            pass


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
            if not pid_alive(row["pid"]):
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
