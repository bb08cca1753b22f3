"""The background publisher: one thread runs queued uploads, in order.

Publishing waits on the network, so it never runs on the caller's thread:
`submit` queues and returns at once (a full queue drops the job and says
so, rather than blocking a generation). Failures are kept as short,
already-redacted strings for `wait()`, which is what `Engine.flush()`
reports. A job's exception is caught here; nothing reaches the caller.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

MAX_KEPT_FAILURES = 100


class Publisher:
    def __init__(self, run: Callable[[object], None], describe: Callable[[BaseException], str], *,
                 max_pending: int = 64, name: str = "mlxcache-remote-publisher"):
        self._run, self._describe, self.max_pending, self._name = run, describe, max_pending, name
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._failures: list[str] = []
        self.failed_total = 0
        self.done_total = 0

    def submit(self, job: object, what: str) -> bool:
        """Queue `job`; False (and a failure for wait()) if the publisher is closed or full."""
        with self._cond:
            if self._closed or len(self._queue) >= self.max_pending:
                why = "closed" if self._closed else f"{self.max_pending} publications already queued"
                self._fail(f"{what}: not published ({why})")
                return False
            self._queue.append((job, what))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._busy

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait until every queued job ran; return (and forget) the failures since the last wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    n = len(self._queue) + self._busy
                    self._failures.append(f"remote publication: {n} still pending after {timeout:g} s")
                    break
                self._cond.wait(left)
            out, self._failures = self._failures, []
            return out

    def close(self, timeout: float | None = 5.0) -> list[str]:
        failures = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        return failures

    def _fail(self, text: str) -> None:  # under the lock
        self.failed_total += 1
        if len(self._failures) < MAX_KEPT_FAILURES:
            self._failures.append(text)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, what = self._queue.popleft()
                self._busy = True
            error = None
            try:
                self._run(job)
            except Exception as e:  # noqa: BLE001 - a publication problem is reported, never raised
                error = f"{what}: {self._describe(e)}"
            with self._cond:
                self._busy = False
                self.done_total += 1
                if error is not None:
                    self._fail(error)
                self._cond.notify_all()
