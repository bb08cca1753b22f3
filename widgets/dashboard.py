"""A live view of the tiered prompt cache: RAM and SSD use, entries, pending
writes, evictions/demotions and counters.

Threading: engine events may arrive on any thread (the SSD writer emits
some). The event callback records the event and marks the view dirty;
widgets are touched on the owner thread only (the thread that built the
dashboard: the kernel's main thread). A full refresh is queued there through
a thread-safe scheduler (the kernel's IO loop `add_callback`, or an asyncio
loop's `call_soon_threadsafe`), so it runs when the cell is done and the
loop is idle; without one, `refresh()` does it. An event that arrives on the
owner thread (during a generation) also updates the light part of the view
at once (`tick()`: bars, counters, log, from `engine.stats()` only), so a
long cell shows live numbers. Both are throttled.

Views are built from `engine.stats()`, `engine.admin.entries()` and event
dicts only: plain Python, never MLX arrays. This module owns the widget and
its threading; `dashboard_state.py` what it knows (counters, log, snapshot),
`dashboard_render.py` the HTML.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import ipywidgets as W

from .dashboard_render import (
    disk_free,
    prefetch_label,
    ram_gauge,
    ram_label,
    render_counters,
    render_entries,
    render_log,
    ssd_enabled,
    remote_label,
    ssd_label,
    write_label,
    write_progress,
)
from .dashboard_state import DashboardState
from .format import esc
from .history import History, memory_label

__all__ = ["ResidencyDashboard"]

PENDING_POLL_S = 0.5  # while writes or reads are pending, refresh this often (when the loop is idle)


def _kernel_scheduler() -> Callable[[Callable[[], None]], None] | None:
    """A thread-safe 'run this on the main thread soon', if we are in a kernel."""
    try:
        from IPython import get_ipython

        ip = get_ipython()
        kernel = getattr(ip, "kernel", None) if ip is not None else None
        loop = getattr(kernel, "io_loop", None)
        if loop is not None and hasattr(loop, "add_callback"):
            return loop.add_callback
    except Exception:  # pragma: no cover
        pass
    try:
        import asyncio

        loop = asyncio.get_running_loop()
        return loop.call_soon_threadsafe
    except RuntimeError:
        return None


def _kernel_call_later() -> Callable[[float, Callable[[], None]], object] | None:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        loop = getattr(getattr(ip, "kernel", None), "io_loop", None) if ip is not None else None
        if loop is not None and hasattr(loop, "call_later"):
            return loop.call_later
    except Exception:  # pragma: no cover
        pass
    return None


class ResidencyDashboard(W.VBox):
    """Live residency view of an Engine. Build it (and display it) on the main thread."""

    def __init__(
        self,
        engine,
        *,
        throttle_s: float = 0.25,
        schedule: Callable[[Callable[[], None]], object] | None = None,
        call_later: Callable[[float, Callable[[], None]], object] | None = None,
        log_size: int = 50,
        **kwargs,
    ):
        self.engine = engine
        self.throttle_s = float(throttle_s)
        self._owner = threading.current_thread()
        self._schedule = schedule if schedule is not None else _kernel_scheduler()
        self._call_later = call_later if call_later is not None else (_kernel_call_later() if schedule is None else None)
        self.state = DashboardState(log_size)
        self._lock = self.state.lock
        self._scheduled = False  # a refresh is queued on the owner's loop
        self._timer = False  # a delayed (throttled) refresh is pending
        self._last_refresh = float("-inf")
        self.refreshes = 0
        self.light_refreshes = 0
        self._last_light = float("-inf")
        self._closed = False

        self.title = W.HTML(value="<b>mlxcache residency</b>")
        self.ram_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="RAM", bar_style="info")
        self.ram_label = W.HTML()
        self.ssd_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="SSD", bar_style="success")
        self.ssd_label = W.HTML()
        self.write_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="writes", bar_style="warning")
        self.write_label = W.HTML()
        self.prefetch_html = W.HTML()
        self.counters_html = W.HTML()
        self.memory_html = W.HTML()
        self.remote_html = W.HTML()
        self.history_html = W.HTML()
        self.history = History()
        self.entries_html = W.HTML()
        self.log_html = W.HTML()
        for w, cls in [
            (self.ram_label, "mlxc-ram"), (self.ssd_label, "mlxc-ssd"), (self.write_label, "mlxc-writes"),
            (self.counters_html, "mlxc-counters-box"), (self.entries_html, "mlxc-entries-box"),
            (self.memory_html, "mlxc-memory-box"), (self.history_html, "mlxc-history-box"),
            (self.remote_html, "mlxc-remote-box"),
            (self.log_html, "mlxc-log-box"), (self.ram_bar, "mlxc-ram-bar"), (self.ssd_bar, "mlxc-ssd-bar"),
            (self.write_bar, "mlxc-write-bar"), (self.prefetch_html, "mlxc-prefetch"),
        ]:
            w.add_class(cls)
        row = lambda a, b: W.HBox([a, b], layout=W.Layout(align_items="center"))  # noqa: E731
        super().__init__(
            children=[
                self.title,
                row(self.ram_bar, self.ram_label),
                row(self.ssd_bar, self.ssd_label),
                row(self.write_bar, self.write_label),
                self.prefetch_html,
                self.remote_html,
                self.memory_html,
                self.history_html,
                self.counters_html,
                self.entries_html,
                self.log_html,
            ],
            **kwargs,
        )
        self.add_class("mlxc-dashboard")
        self.state.seed(getattr(getattr(engine, "events", None), "recent", ()))
        self._unsubscribe = engine.events.subscribe(self._on_event)
        self.refresh()

    # --- events (any thread) ---

    def _on_event(self, event: dict) -> None:
        if self._closed:
            return
        self.state.record(event)
        if threading.current_thread() is self._owner:
            # Inside the engine's emit, maybe mid-operation: only the light
            # view (stats, which reads counters and never polls), throttled;
            # the entries table waits for the queued full refresh.
            self.tick()
        self._request()

    def tick(self) -> None:
        """Light refresh (bars, counters, log from engine.stats()) if dirty and
        the throttle allows; the engine is not polled. Owner thread only: safe
        to call from inside engine callbacks (events, on_progress, on_text)."""
        if self._closed or threading.current_thread() is not self._owner:
            return
        if time.monotonic() - self._last_light < self.throttle_s:
            return
        self._last_light = time.monotonic()
        log = self.state.log_items()
        try:
            stats = dict(self.engine.stats())
        except Exception:
            return
        self.light_refreshes += 1
        self.state.update(stats)
        self._show_stats(log)

    def _request(self) -> None:
        """Ask the owner thread to refresh soon (thread-safe)."""
        if self._schedule is None:
            return
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._schedule(self._scheduled_refresh)
        except Exception:  # loop closed: the next owner-thread event refreshes
            with self._lock:
                self._scheduled = False

    def _scheduled_refresh(self) -> None:
        with self._lock:
            self._scheduled = False
        self._maybe_refresh()

    def _timer_fired(self) -> None:
        self._timer = False
        self._maybe_refresh()

    # --- owner thread ---

    def _maybe_refresh(self) -> None:
        if self._closed or threading.current_thread() is not self._owner:
            return
        if not self.state.dirty:
            return
        wait = self._last_refresh + self.throttle_s - time.monotonic()
        if wait <= 0:
            self.refresh()
        elif not self._timer and self._call_later is not None:
            self._timer = True
            self._call_later(wait, self._timer_fired)

    def refresh(self) -> None:
        """Rebuild the whole view now from engine.stats() and engine.admin.entries().

        Owner thread, at a safe point (between cells; not from inside an
        engine callback: admin.entries() applies finished background work).
        From another thread it only queues a refresh."""
        if self._closed:
            return
        if threading.current_thread() is not self._owner:
            self.state.mark_dirty()
            self._request()
            return
        log = self.state.log_items(clean=True)
        self._last_refresh = self._last_light = time.monotonic()
        self.refreshes += 1
        eng = self.engine
        try:
            stats = dict(eng.stats())
        except Exception as exc:  # a closed engine, say
            self.title.value = f"<b>mlxcache residency</b> — <i>{esc(exc)}</i>"
            return
        self.state.update(stats, eng.admin.entries())
        self._show_stats(log)
        self._set(self.entries_html, render_entries(self.state.entries))
        if (stats.get("pending_writes") or stats.get("prefetches_in_progress")) and self._call_later is not None \
                and not self._timer:
            # the writer and the reader report progress by polling, not events
            self._timer = True
            self.state.mark_dirty()
            self._call_later(PENDING_POLL_S, self._timer_fired)

    @staticmethod
    def _set(widget, value) -> None:
        if widget.value != value:
            widget.value = value

    def _show_stats(self, log: list) -> None:
        """Bars, their labels, counters and log from the state's last stats."""
        s = self.state.stats
        value, maximum, style = ram_gauge(s)
        self._bar(self.ram_bar, value, maximum)
        if self.ram_bar.bar_style != style:
            self.ram_bar.bar_style = style
        self._set(self.ram_label, ram_label(s))
        if ssd_enabled(s):  # no cap: against what the disk could still hold (a full bar meant full)
            used = s.get("ssd_bytes") or 0
            self._bar(self.ssd_bar, used, s.get("ssd_budget_bytes") or used + disk_free(s.get("cache_dir")))
        else:
            self._bar(self.ssd_bar, 0, 1)
        self._set(self.ssd_label, ssd_label(s))
        done, total = write_progress(s)
        self._bar(self.write_bar, done if total else 0, total or 1)
        self._set(self.write_label, write_label(s))
        self._set(self.prefetch_html, prefetch_label(s))
        self._set(self.memory_html, memory_label(s))
        self._set(self.remote_html, remote_label(s))
        self.history.add(s)
        self._set(self.history_html, self.history.render())
        self._set(self.counters_html, render_counters(self.state.counters))
        self._set(self.log_html, render_log(log))

    # what the view last showed (read by tests and notebooks), kept in self.state
    events_seen = property(lambda self: self.state.events_seen, doc="engine events received")
    counters = property(lambda self: self.state.counters, doc="the counters shown, by name")
    last_stats = property(lambda self: self.state.stats, doc="the engine.stats() last shown")
    last_entries = property(lambda self: self.state.entries, doc="the engine.admin.entries() last shown")

    def _bar(self, bar, value, maximum) -> None:
        maximum = float(maximum) if maximum else max(1.0, float(value or 0))
        value = min(float(value or 0), maximum)
        if bar.max != maximum:
            if maximum < bar.value:
                bar.value = 0.0
            bar.max = maximum
        if bar.value != value:
            bar.value = value

    def close(self) -> None:
        """Unsubscribe from the engine and close the widgets."""
        if not self._closed:
            self._closed = True
            try:
                self._unsubscribe()
            except Exception:  # pragma: no cover
                pass
        if threading.current_thread() is self._owner:
            for w in self._all_widgets():
                if w is not self:
                    w.close()
            super().close()

    def _all_widgets(self):
        out, stack = [], [self]
        while stack:
            w = stack.pop()
            out.append(w)
            stack.extend(getattr(w, "children", ()) or ())
        return out
