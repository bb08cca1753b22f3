"""Whether a generation runs: background threads (the writer, the reader) yield
the cores to it. On the CPU, BLAS wants every core a generation can get.

The owner marks a generation with `with gate.generating():` (nesting is
fine); a background thread asks `running` between units of work and sleeps
in `wait_idle()`, with a timeout, while it is true.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager


class GenerationGate:
    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._idle = threading.Event()  # set whenever no generation runs
        self._idle.set()

    @contextmanager
    def generating(self):
        with self._lock:
            self._depth += 1
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if not self._depth:
                    self._idle.set()

    @property
    def running(self) -> bool:
        return not self._idle.is_set()

    def wait_idle(self, timeout: float) -> bool:
        """Sleep until no generation runs (or `timeout` s); True when none does."""
        return self._idle.wait(timeout)
