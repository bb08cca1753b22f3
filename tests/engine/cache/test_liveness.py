"""Liveness where the OS can say more than a heartbeat (issue 27): a process's start time and
state, as psutil reads them on Linux and macOS, against real subprocesses: a stopped one is
alive, a zombie (killed, not yet reaped) is dead, a pid that names another process now is
not the process of the row. The start is stored as it always was (Linux: clock ticks since
boot, /proc/<pid>/stat's 22nd field; macOS: microseconds since the epoch), so processes of
an older build on the same directory still agree with this one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mlxcache_kernel.engine.cache.catalog import liveness
from mlxcache_kernel.engine.cache.catalog.liveness import STOPPED, Identity, Peers

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def row(pid: int, start: int | None, me: Identity) -> dict:
    """A procs row of a process on our boot and in our PID namespace."""
    return {"owner": f"peer-{pid}-{start}", "pid": pid, "start": start, "boot": me.boot, "pidns": me.pidns}


def wait_until(p: subprocess.Popen, state: int) -> None:
    """Until the child is stopped (WSTOPPED) or a zombie (WEXITED), leaving it so (WNOWAIT)."""
    os.waitid(os.P_PID, p.pid, state | os.WNOWAIT)


def test_start_times_are_stored_as_before_and_tell_processes_apart():
    me = liveness.process_start("self")
    assert me is not None and me == liveness.process_start(os.getpid())
    before = time.time()
    p = subprocess.Popen(SLEEPER)
    try:
        start = liveness.process_start(p.pid)
        assert start is not None and start == liveness.process_start(p.pid) and start != me
        if sys.platform == "darwin":  # microseconds since the epoch
            assert before - 1 <= start / 1e6 <= time.time() + 1, (before, start)
        else:  # clock ticks since boot, as /proc says
            with open(f"/proc/{p.pid}/stat", "rb") as f:
                assert start == int(f.read().rsplit(b")", 1)[1].split()[19])
    finally:
        p.kill()
        p.wait()
    assert liveness.process_start(p.pid) is None and liveness.process_state(p.pid) is None


def test_a_stopped_process_is_alive_and_a_zombie_dead(tmp_path):
    me = Identity.current()
    assert me.start is not None and me.boot and me.pidns
    peers = Peers(me, "me", tmp_path)  # (no heartbeat files: only the pid and start decide)
    p = subprocess.Popen(SLEEPER)
    try:
        start = liveness.process_start(p.pid)
        assert peers.alive(row(p.pid, start, me)) and liveness.process_state(p.pid) not in STOPPED
        os.kill(p.pid, signal.SIGSTOP)  # Ctrl-Z, a debugger: it holds what it held, it comes back
        wait_until(p, os.WSTOPPED)
        assert liveness.process_state(p.pid) in STOPPED
        assert liveness.process_start(p.pid) == start and peers.alive(row(p.pid, start, me))
        assert not peers.alive(row(p.pid, start - 1, me)), "the pid names another process than the row's"
        os.kill(p.pid, signal.SIGKILL)
        wait_until(p, os.WEXITED)  # a zombie: killed, not reaped
        assert liveness.process_start(p.pid) is None and liveness.process_state(p.pid) is None
        assert not peers.alive(row(p.pid, start, me))
    finally:
        p.kill()
        p.wait()
    assert not peers.alive(row(p.pid, start, me))


def test_without_a_start_time_the_pid_and_then_the_heartbeat_decide(tmp_path):
    """A row without a start (where the OS did not say): a dead pid is dead at once, a live
    one is judged by its heartbeat."""
    me = Identity.current()
    peers = Peers(me, "me", tmp_path)
    p = subprocess.Popen(SLEEPER)
    p.kill()
    p.wait()
    assert not peers.alive(row(p.pid, None, me))
    assert peers.alive(row(os.getppid(), None, me)), "alive: not yet seen to miss a heartbeat"
