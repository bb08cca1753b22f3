"""Named fault points for crash tests (tests/engine/cache/test_faults.py): every filesystem and
catalogue step of the SSD tier calls `fault("name")`, a no-op unless the
environment names that point (read once, at import).

    MLXCACHE_FAULT=POINT:ACTION[@N]

    kill        SIGKILL this process at the point
    enospc      raise OSError(ENOSPC) there; at a "<label>.commit" point, SQLite's
                SQLITE_FULL after the transaction rolled back by itself (as SQLite
                does on a full disk)
    eio         raise OSError(EIO) there; at a "<label>.commit" point, SQLITE_IOERR
                with the transaction still open
    wait=PATH   create PATH and wait until it is removed (a live process paused there)
    @N          the Nth time the point is reached (default: the first); once

MLXCACHE_FAULT_TRACE=PATH appends every point reached to PATH, one per line
(how a test lists the points of a scenario). `observe(fn)` calls fn(point, db) at
every point reached (the power-loss recorder, tests/support/power_loss.py).
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import time
from typing import Callable

_spec = os.environ.get("MLXCACHE_FAULT") or None
_trace = os.environ.get("MLXCACHE_FAULT_TRACE") or None
_seen: dict[str, int] = {}
_observer: Callable[[str, sqlite3.Connection | None], None] | None = None


def observe(fn: Callable[[str, sqlite3.Connection | None], None] | None) -> None:
    """Call fn(point, db) at every fault point this process reaches (None: stop)."""
    global _observer
    _observer = fn


def fault(point: str, db: sqlite3.Connection | None = None) -> None:
    """Fail, die or pause here if MLXCACHE_FAULT names this point (`db`: at a COMMIT)."""
    if _spec is None and _trace is None and _observer is None:
        return
    if _observer is not None:
        _observer(point, db)
    if _trace is not None:
        with open(_trace, "a") as f:
            f.write(point + "\n")
    if _spec is None:
        return
    name, _, action = _spec.partition(":")
    action, _, nth = action.partition("@")
    if name != point:
        return
    _seen[point] = _seen.get(point, 0) + 1
    if _seen[point] != int(nth or 1):
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("wait="):
        path = action.removeprefix("wait=")
        open(path, "w").close()
        while os.path.exists(path):
            time.sleep(0.02)
    elif action in ("enospc", "eio"):
        if db is not None:  # a failed COMMIT, as SQLite reports it
            if action == "enospc":
                db.execute("ROLLBACK")
            error = sqlite3.OperationalError("database or disk is full" if action == "enospc" else "disk I/O error")
            error.sqlite_errorcode, error.sqlite_errorname = (13, "SQLITE_FULL") if action == "enospc" else (
                10, "SQLITE_IOERR")
            raise error
        code = errno.ENOSPC if action == "enospc" else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (fault injected at {point})")
    else:
        raise ValueError(f"MLXCACHE_FAULT: unknown action {action!r}")
