"""Liveness where the OS can say more than a heartbeat (issue 27): the process start time,
from /proc on Linux and from sysctl KERN_PROC_PID on macOS. On Linux the macOS path is
checked as far as it can be: the documented layout of `struct kinfo_proc`'s head and
the parsing of a buffer laid out as macOS answers."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys

import pytest

from mlxcache_kernel.engine.cache.catalog import liveness
from mlxcache_kernel.engine.cache.catalog.liveness import ExternProcHead, parse_kinfo_proc


def kinfo_proc(pid: int, sec: int, usec: int, stat: int = 2) -> bytes:
    """A struct kinfo_proc as 64-bit macOS lays it out (offsets from <sys/proc.h>, by hand)."""
    raw = bytearray(liveness.KINFO_PROC_SIZE)
    struct.pack_into("<qi", raw, 0, sec, usec)  # p_un.__p_starttime
    struct.pack_into("<QQ", raw, 16, 0xDEAD0000, 0xBEEF0000)  # p_vmspace, p_sigacts
    struct.pack_into("<iB", raw, 32, 0x4004, stat)  # p_flag, p_stat (SRUN = 2)
    struct.pack_into("<i", raw, 40, pid)  # p_pid
    return bytes(raw)


def test_the_documented_layout():
    assert [(f, getattr(ExternProcHead, f).offset) for f, _ in ExternProcHead._fields_] == [
        ("p_starttime", 0), ("p_vmspace", 16), ("p_sigacts", 24), ("p_flag", 32), ("p_stat", 36), ("p_pid", 40)]
    assert ctypes.sizeof(ExternProcHead) <= liveness.KINFO_PROC_SIZE


def test_parsing_sysctls_answer():
    assert parse_kinfo_proc(kinfo_proc(4242, 1_764_000_000, 123_456), 4242) == 1_764_000_000_123_456
    assert parse_kinfo_proc(kinfo_proc(4242, 1_764_000_000, 0, stat=5), 4242) is None  # a zombie (SZOMB)
    assert parse_kinfo_proc(kinfo_proc(4243, 1_764_000_000, 0), 4242) is None  # another process's
    assert parse_kinfo_proc(b"", 4242) is None  # sysctl's answer for no such process


@pytest.mark.skipif(sys.platform == "darwin", reason="Linux: /proc")
def test_linux_start_times_tell_processes_apart():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = liveness.process_start(p.pid)
        assert start is not None and start == liveness.process_start(p.pid)
        assert liveness.process_start("self") == liveness.process_start(os.getpid())
    finally:
        p.kill()
        p.wait()
    assert liveness.process_start(p.pid) is None


@pytest.mark.skipif(sys.platform != "darwin", reason="macOS: sysctl")
def test_darwin_start_times_tell_processes_apart():
    me = liveness.process_start("self")
    assert me is not None and me == liveness.process_start(os.getpid())
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert liveness.process_start(p.pid) not in (None, me)
    finally:
        p.kill()
        p.wait()
    assert liveness.process_start(p.pid) is None
