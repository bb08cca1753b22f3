"""A circuit breaker: stop calling a remote that keeps failing, then try it again.

After `threshold` consecutive failures the breaker opens for a cool-down
(base, doubling with each failed retry, up to a cap). When the cool-down
ends one call is let through (half-open): success closes the breaker,
failure reopens it for twice as long. A dead server thus costs a few
timeouts per cool-down, not one per lookup, and a recovered one is used
again within the cap.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Breaker:
    def __init__(self, threshold: int = 3, base_s: float = 1.0, cap_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if threshold < 1 or base_s <= 0 or cap_s < base_s:
            raise ValueError("breaker needs threshold >= 1 and 0 < base_s <= cap_s")
        self.threshold, self.base_s, self.cap_s, self.clock = threshold, base_s, cap_s, clock
        self._lock = threading.Lock()
        self._failures = 0  # consecutive
        self._opened = 0  # consecutive openings: sets the cool-down
        self._until: float | None = None  # monotonic time the cool-down ends; None: closed
        self._trial = False  # a half-open trial call is under way
        self.last_error: str | None = None
        self.opened_total = 0

    def allow(self) -> bool:
        """May a call go to the remote now? (A True in half-open state must be followed by success/failure.)"""
        with self._lock:
            if self._until is None:
                return True
            if self.clock() < self._until or self._trial:
                return False
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self._failures = self._opened = 0
            self._until, self._trial = None, False

    def failure(self, error: str, trip: bool = False) -> bool:
        """Record a failed call (`error` already redacted); True if this opened the breaker.
        trip=True (a call cut at its deadline: a stalled server) opens it without waiting for `threshold`."""
        with self._lock:
            self.last_error = error
            self._failures += 1
            if not self._trial and (self._until is not None or (self._failures < self.threshold and not trip)):
                return False
            self._trial = False
            self._opened += 1
            self.opened_total += 1
            self._until = self.clock() + min(self.cap_s, self.base_s * 2 ** (self._opened - 1))
            return True

    def is_open(self) -> bool:
        with self._lock:
            return self._until is not None and (self.clock() < self._until or self._trial)

    def state(self) -> str:
        """'ok', 'open until HH:MM:SS (n consecutive failures)', or 'half-open (retrying)'."""
        with self._lock:
            if self._until is None:
                return "ok"
            left = self._until - self.clock()
            if left <= 0:
                return "half-open (retrying)" if self._trial else "half-open (next call retries)"
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
            return f"open until {until} ({self._failures} consecutive failures)"
