"""Workers paused at a named point, and a clock a test moves: the tools of the contention
and fencing tests (engine/cache/test_contention.py, engine/cache/test_fencing.py).

`Paused` runs fault_worker.py with MLXCACHE_FAULT=POINT:wait=FLAG: it stops there, alive
and beating (its heartbeat thread runs on). `stop()` then freezes the whole process
(SIGSTOP: no heartbeat either, as Ctrl-Z, a debugger or `docker pause` do), `resume()`
lets it go on from the point and returns what it acknowledged.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from repo_paths import SUPPORT

WORKER = str(SUPPORT / "fault_worker.py")
# the workers import this checkout (or, under scripts/mutations.py, the mutated copy first)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(SUPPORT)) if p)}


class Clock:
    """A monotonic clock a test moves forward (a laptop that slept, a clock that jumped)."""

    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class Paused:
    """fault_worker.py running SCENARIO, paused (alive, beating) at POINT until resumed."""

    def __init__(self, root: Path, scenario: str, point: str, *, boot: str | None = None, unshare: bool = False,
                 env: dict | None = None):
        self.flag, self.log = root.parent / f"{point}.waiting", root.parent / f"{scenario}.log"
        env = {**ENV, **(env or {}), "MLXCACHE_FAULT": f"{point}:wait={self.flag}"} | (
            {"MLXCACHE_BOOT_ID": boot} if boot else {})
        cmd = [sys.executable, WORKER, str(root), scenario, str(self.log)]
        self.p = subprocess.Popen((["unshare", "--pid", "--fork"] if unshare else []) + cmd, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 120
        while not self.flag.exists():
            assert self.p.poll() is None, self.p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the worker never reached its point"
            time.sleep(0.02)

    def stop(self) -> None:
        """Freeze it whole (its heartbeat too); `resume()` continues it."""
        os.killpg(self.p.pid, signal.SIGSTOP)
        self.stopped = True

    def resume(self) -> list[dict]:
        os.unlink(self.flag)
        if getattr(self, "stopped", False):
            os.killpg(self.p.pid, signal.SIGCONT)
        assert self.p.wait(120) == 0, self.p.communicate()[1][-3000:]
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def kill(self) -> None:
        os.killpg(self.p.pid, signal.SIGKILL)
        self.p.wait(60)
