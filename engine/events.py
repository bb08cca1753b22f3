"""Engine events: plain dict records fanned out to subscribers.

Publishing never touches MLX arrays and never raises: a failing subscriber is
dropped from that delivery, not allowed to break generation.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable


class EventBus:
    def __init__(self, history: int = 500):
        self._lock = threading.Lock()
        self._subscribers: list[Callable[[dict], None]] = []
        self.recent: deque = deque(maxlen=history)

    def subscribe(self, callback: Callable[[dict], None]) -> Callable[[], None]:
        """Call `callback(event)` for each event (from any thread); returns an unsubscribe."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def emit(self, type: str, **fields) -> dict:
        event = {"type": type, "time": time.time(), **fields}
        with self._lock:
            self.recent.append(event)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception:  # a broken view must not break the engine
                pass
        return event
