"""Progress of a long prefill or SSD restore: tokens done of total, rate, ETA.

`GenerationProgress` is an ipywidgets bar for `%%generate` output;
`TextProgress` is the same thing as one carriage-return line for frontends
without widgets. Both take `update(phase, done, total)` (the engine's
`on_progress` signature) and `finish()`, which removes the bar so the cell's
footer takes its place. Updates are throttled; the first and last update of
each phase always show.

Both are meant to be driven from the thread that runs the generation (the
kernel's main thread); an update arriving on another thread is recorded and
shown by the next update on the owner thread (or dropped at `finish()`).
"""

from __future__ import annotations

import sys
import threading
import time

import ipywidgets as W

from .format import esc, progress_line

__all__ = ["GenerationProgress", "TextProgress", "ProgressTracker"]


class ProgressTracker:
    """Rate and ETA bookkeeping for one phase at a time (plain Python)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.phase: str | None = None
        self.done = 0
        self.total = 0
        self._t0 = 0.0
        self._done0 = 0

    def update(self, phase: str, done: int, total: int) -> bool:
        """Record; True when the phase changed (a new bar)."""
        now = self.clock()
        new = phase != self.phase or done < self.done
        if new:
            self.phase, self._t0, self._done0 = phase, now, int(done)
        self.done, self.total = int(done), int(total)
        return new

    @property
    def elapsed(self) -> float:
        return max(0.0, self.clock() - self._t0)

    @property
    def rate(self) -> float | None:
        el = self.elapsed
        d = self.done - self._done0
        return d / el if el > 0 and d > 0 else None

    @property
    def eta(self) -> float | None:
        r = self.rate
        if r is None or self.total <= 0:
            return None
        return max(0.0, (self.total - self.done) / r)

    def line(self) -> str:
        return progress_line(self.phase or "", self.done, self.total, self.rate, self.eta)


class _Throttle:
    def __init__(self, interval_s: float, clock=time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._last = float("-inf")

    def ready(self, force: bool = False) -> bool:
        now = self.clock()
        if force or now - self._last >= self.interval_s:
            self._last = now
            return True
        return False


PHASE_LABELS = {"prefill": "Prefill", "restore": "Restoring from SSD", "decode": "Generating", "score": "Scoring"}


class GenerationProgress(W.HBox):
    """A progress bar widget: `update(phase, done, total)`, then `finish()`."""

    def __init__(self, *, throttle_s: float = 0.1, clock=time.monotonic, **kwargs):
        self._owner = threading.current_thread()
        self.tracker = ProgressTracker(clock)
        self._throttle = _Throttle(throttle_s, clock)
        self.bar = W.IntProgress(value=0, min=0, max=1, bar_style="info", layout=W.Layout(width="40%"))
        self.label = W.HTML(value="")
        self.bar.add_class("mlxc-progress-bar")
        self.label.add_class("mlxc-progress-label")
        super().__init__(children=[self.bar, self.label], **kwargs)
        self.add_class("mlxc-progress")
        self.finished = False
        self.updates_shown = 0

    def update(self, phase: str, done: int, total: int) -> None:
        if self.finished:
            return
        new_phase = self.tracker.update(phase, done, total)
        if threading.current_thread() is not self._owner:
            return  # never touch widgets off the owner thread; next update shows it
        if not self._throttle.ready(force=new_phase or done >= total):
            return
        self._show()

    def _show(self) -> None:
        t = self.tracker
        self.bar.max = max(1, t.total)
        self.bar.value = min(t.done, self.bar.max)
        self.bar.description = PHASE_LABELS.get(t.phase, t.phase or "")
        self.label.value = f"<span style='font-family:monospace'>{esc(t.line())}</span>"
        self.updates_shown += 1

    def finish(self) -> None:
        """Remove the bar (the footer replaces it)."""
        if self.finished:
            return
        self.finished = True
        if threading.current_thread() is self._owner:
            self.layout.display = "none"
            self.close()

    # a context manager: `with GenerationProgress() as p: eng.generate(..., on_progress=p.update)`
    def __enter__(self) -> "GenerationProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()


class TextProgress:
    """The same progress as one line on a text stream, rewritten with '\\r'."""

    def __init__(self, stream=None, *, throttle_s: float = 0.5, clock=time.monotonic):
        self.stream = stream if stream is not None else sys.stdout
        self.tracker = ProgressTracker(clock)
        self._throttle = _Throttle(throttle_s, clock)
        self._owner = threading.current_thread()
        self._width = 0
        self.finished = False

    def update(self, phase: str, done: int, total: int) -> None:
        if self.finished:
            return
        new_phase = self.tracker.update(phase, done, total)
        if threading.current_thread() is not self._owner:
            return
        if not self._throttle.ready(force=new_phase or done >= total):
            return
        line = PHASE_LABELS.get(phase, phase) + ": " + self.tracker.line().split(" ", 1)[1]
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._width and threading.current_thread() is self._owner:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()

    def __enter__(self) -> "TextProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.finish()

