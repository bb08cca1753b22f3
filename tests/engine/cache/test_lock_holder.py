"""A process stopped while it holds the catalogue's write lock (SIGSTOP: Ctrl-Z, a debugger)
is named where a cell's wait is reported (`late_reason`, `%cache stats` ssd_late_reason):
its pid, its host, that it is stopped and for how long it has held the lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore

HOLD = textwrap.dedent("""
    import sys, time
    from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
    s = CheckpointStore(sys.argv[1])
    with s.catalog.transaction("hold"):
        print("held", flush=True)
        time.sleep(120)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stopped state is read from /proc")
def test_a_stopped_lock_holder_is_named(tmp_path):
    s = CheckpointStore(tmp_path / "c")
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "c")], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        os.kill(p.pid, signal.SIGSTOP)
        assert s.catalog.locked_elsewhere()
        reason = s.stats()["late_reason"]
        assert f"held by pid {p.pid} on " in reason and "which is stopped" in reason, reason
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()
    assert not s.catalog.locked_elsewhere() and s.stats()["late_reason"] is None
    s.close()


def test_a_running_holder_is_named_without_a_state(tmp_path):
    s = CheckpointStore(tmp_path / "c")
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "c")], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        assert s.catalog.locked_elsewhere()
        reason = s.stats()["late_reason"]
        assert f"held by pid {p.pid} on " in reason and "stopped" not in reason, reason
    finally:
        p.kill()
        p.wait()
    s.close()
