"""The background publisher: one thread runs queued jobs (uploads, TTL refreshes), in order.

Publishing waits on the network, so it never runs on the caller's thread:
`submit` queues and returns at once (a full queue drops the job and says
so, rather than blocking a generation). Failures are kept as short,
already-redacted strings for `wait()`, which is what `Engine.flush()`
reports. A job's exception is caught here; nothing reaches the caller.
`close()` waits a bounded time and names every job it leaves unfinished.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

MAX_KEPT_FAILURES = 100


class Publisher:
    def __init__(self, describe: Callable[[BaseException], str], *, max_pending: int = 64,
                 name: str = "mlxcache-remote-publisher"):
        self._describe, self.max_pending, self._name = describe, max_pending, name
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._busy: str | None = None  # what the running job does
        self._closed = False
        self._thread: threading.Thread | None = None
        self._failures: list[str] = []
        self.failed_total = 0
        self.done_total = 0

    def submit(self, job: Callable[[], None], what: str, *, report: bool = True) -> bool:
        """Queue `job()`; False if the publisher is closed or full (a failure for wait() if `report`)."""
        with self._cond:
            if self._closed or len(self._queue) >= self.max_pending:
                why = "closed" if self._closed else f"{self.max_pending} publications already queued"
                if report:
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
            return len(self._queue) + (self._busy is not None)

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait until every queued job ran; return (and forget) the failures since the last wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    n = len(self._queue) + (self._busy is not None)
                    self._failures.append(f"remote publication: {n} still pending after {timeout:g} s")
                    break
                self._cond.wait(left)
            out, self._failures = self._failures, []
            return out

    def close(self, timeout: float | None = 5.0) -> list[str]:
        """Wait at most `timeout`, then stop: the failures, and each job left unfinished by name."""
        failures = self.wait(timeout)
        with self._cond:
            self._closed = True
            left = ([f"{self._busy}: not finished (closing)"] if self._busy is not None else []) + [
                f"{what}: not published (closing)" for _, what in self._queue]
            self._queue.clear()
            self._cond.notify_all()
        return failures + left

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
                self._busy = what
            error = None
            try:
                job()
            except Exception as e:  # noqa: BLE001 - a publication problem is reported, never raised
                error = f"{what}: {self._describe(e)}"
            with self._cond:
                self._busy: str | None = None  # what the running job does
                self.done_total += 1
                if error is not None:
                    self._fail(error)
                self._cond.notify_all()
