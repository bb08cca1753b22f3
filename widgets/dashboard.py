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

Views are built from `engine.stats()`, `engine.cache_entries()` and event
dicts only: plain Python, never MLX arrays.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

import ipywidgets as W

from .format import esc, fmt_ago, fmt_bytes, fmt_count, fmt_seconds, preview_text

__all__ = ["ResidencyDashboard", "render_counters", "render_entries", "render_log", "counters_from_stats"]

LOG_TYPES = ("evict", "demote", "supersede", "quarantine", "write_failed", "restore_failed", "restore_skipped", "remove")
MAX_ROWS = 50
PENDING_POLL_S = 0.5  # while writes are pending, refresh this often (when the loop is idle)

CSS = """
<style>
.mlxc-dashboard table.mlxc-t {border-collapse: collapse; font-size: 12px; width: 100%;}
.mlxc-dashboard table.mlxc-t th, .mlxc-dashboard table.mlxc-t td {padding: 2px 6px; text-align: left;
  border-bottom: 1px solid var(--jp-border-color2, #ddd); white-space: nowrap;}
.mlxc-dashboard table.mlxc-t td.num, .mlxc-dashboard table.mlxc-t th.num {text-align: right;}
.mlxc-dashboard td.mlxc-preview {font-family: var(--jp-code-font-family, monospace); white-space: pre;
  max-width: 32em; overflow: hidden; text-overflow: ellipsis;}
.mlxc-dashboard .mlxc-counters {display: flex; flex-wrap: wrap; gap: 4px 16px; font-size: 12px;}
.mlxc-dashboard .mlxc-counter b {font-family: var(--jp-code-font-family, monospace);}
.mlxc-dashboard .mlxc-state-failed {color: #c62828; font-weight: bold;}
.mlxc-dashboard .mlxc-state-pending {color: #ef6c00;}
.mlxc-dashboard .mlxc-state-dirty {color: #f9a825;}
.mlxc-dashboard .mlxc-state-committed {color: #2e7d32;}
.mlxc-dashboard .mlxc-h {font-weight: bold; font-size: 12px; margin-top: 4px;}
.mlxc-dashboard .mlxc-scroll {max-height: 15em; overflow-y: auto;}
</style>
"""

# (label, key in counters_from_stats, kind)
COUNTERS = [
    ("RAM hits", "ram_hits", "n"),
    ("SSD hits", "ssd_hits", "n"),
    ("misses", "misses", "n"),
    ("prompt tokens saved", "tokens_saved", "n"),
    ("prefill saved", "prefill_s_saved", "s"),
    ("bytes written", "bytes_written", "b"),
    ("bytes read", "bytes_read", "b"),
    ("writes committed", "writes_committed", "n"),
    ("failures", "failures", "n"),
    ("quarantined", "quarantined", "n"),
    ("evictions", "evictions", "n"),
    ("demotions", "demotions", "n"),
]


def counters_from_stats(s: dict) -> dict:
    """The dashboard's counters from a flat `engine.stats()` dict."""
    g = lambda k, d=0: s.get(k) if s.get(k) is not None else d  # noqa: E731
    return {
        "ram_hits": g("hits"),
        "ssd_hits": g("ssd_hits"),
        "misses": g("misses"),
        "tokens_saved": g("engine_cached_tokens"),
        "prefill_s_saved": float(g("engine_prefill_s_saved", 0.0)),
        "bytes_written": g("bytes_written"),
        "bytes_read": g("ssd_restore_bytes"),
        "writes_committed": g("writes_committed"),
        "failures": g("writes_failed") + g("ssd_restore_failures"),
        "writes_failed": g("writes_failed"),
        "restore_failures": g("ssd_restore_failures"),
        "quarantined": g("ssd_quarantined"),
        "evictions": g("evictions") + g("oversized"),
        "demotions": g("demotions"),
    }


def render_counters(c: dict) -> str:
    items = []
    for label, key, kind in COUNTERS:
        v = c.get(key)
        text = fmt_bytes(v) if kind == "b" else fmt_seconds(v) if kind == "s" else fmt_count(v)
        items.append(
            f"<span class='mlxc-counter' data-name='{key}' data-value='{esc(v)}'>{esc(label)}: <b>{esc(text)}</b></span>"
        )
    return CSS + "<div class='mlxc-counters'>" + "".join(items) + "</div>"


def _who(e: dict) -> str:
    parts = [f"session {s}" for s in (e.get("sessions") or [])]
    parts += [f"📌 {p}" for p in (e.get("pinned") or [])]
    return ", ".join(parts) or "–"


def render_entries(entries: list[dict], now: float | None = None) -> str:
    if not entries:
        return "<div class='mlxc-h'>Entries</div><div class='mlxc-entries mlxc-empty'>no cached prefixes yet</div>"
    rows = sorted(entries, key=lambda e: e.get("last_used") or 0, reverse=True)
    head = (
        "<tr><th>prefix</th><th class='num'>tokens</th><th class='num'>bytes</th><th>tier</th><th>write</th>"
        "<th class='num'>borrowers</th><th>session / pinned</th><th class='num'>hits</th><th>last use</th></tr>"
    )
    body = []
    for e in rows[:MAX_ROWS]:
        state = e.get("write_state") or "none"
        body.append(
            "<tr class='mlxc-entry'>"
            f"<td class='mlxc-preview' title='{esc(preview_text(e.get('preview'), 400))}'>{esc(preview_text(e.get('preview'), 90))}</td>"
            f"<td class='num'>{fmt_count(e.get('tokens'))}</td>"
            f"<td class='num'>{esc(fmt_bytes(e.get('bytes')))}</td>"
            f"<td>{esc(e.get('tier'))}</td>"
            f"<td class='mlxc-state-{esc(state)}'>{esc(state)}</td>"
            f"<td class='num'>{fmt_count(e.get('borrowers') or 0)}</td>"
            f"<td>{esc(_who(e))}</td>"
            f"<td class='num'>{fmt_count(e.get('hits') or 0)}</td>"
            f"<td>{esc(fmt_ago(e.get('last_used'), now))}</td>"
            "</tr>"
        )
    more = f"<div>… and {len(rows) - MAX_ROWS} more</div>" if len(rows) > MAX_ROWS else ""
    return (
        f"<div class='mlxc-h'>Entries ({len(rows)})</div>"
        f"<div class='mlxc-scroll'><table class='mlxc-t mlxc-entries'>{head}{''.join(body)}</table></div>{more}"
    )


def _describe(ev: dict) -> str:
    t = ev.get("type")
    bits = []
    if ev.get("tokens") is not None:
        bits.append(f"{fmt_count(ev['tokens'])} tokens")
    nbytes = ev.get("nbytes", ev.get("bytes"))
    if nbytes is not None:
        bits.append(fmt_bytes(nbytes))
    if t == "supersede" and ev.get("by_tokens") is not None:
        bits.append(f"by {fmt_count(ev['by_tokens'])} tokens")
    if ev.get("path") and t in ("quarantine", "evict"):
        bits.append(str(ev["path"]).rsplit("/", 1)[-1][:16] + "…")
        if t == "evict":
            bits.append("SSD")
    if ev.get("error"):
        bits.append(preview_text(ev["error"], 80))
    return ", ".join(bits)


def render_log(events) -> str:
    rows = []
    for ev in reversed(list(events)):
        ts = time.strftime("%H:%M:%S", time.localtime(ev.get("time") or time.time()))
        rows.append(
            f"<tr class='mlxc-log-row mlxc-log-{esc(ev.get('type'))}'><td>{ts}</td><td>{esc(ev.get('type'))}</td>"
            f"<td>{esc(ev.get('reason') or '')}</td><td>{esc(_describe(ev))}</td></tr>"
        )
    if not rows:
        return "<div class='mlxc-h'>Evictions and demotions</div><div class='mlxc-log mlxc-empty'>none yet</div>"
    return (
        f"<div class='mlxc-h'>Evictions and demotions ({len(rows)})</div><div class='mlxc-scroll'><table class='mlxc-t mlxc-log'>"
        "<tr><th>time</th><th>event</th><th>reason</th><th>what</th></tr>" + "".join(rows) + "</table></div>"
    )


def _snapshot(items) -> list:
    """list() of a deque that another thread may append to meanwhile."""
    for _ in range(5):
        try:
            return list(items)
        except RuntimeError:  # mutated during iteration
            continue
    return []


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
        self._lock = threading.Lock()
        self._dirty = True
        self._scheduled = False  # a refresh is queued on the owner's loop
        self._timer = False  # a delayed (throttled) refresh is pending
        self._last_refresh = float("-inf")
        self._log: deque = deque(maxlen=log_size)
        self.events_seen = 0
        self.refreshes = 0
        self.light_refreshes = 0
        self._last_light = float("-inf")
        self.last_stats: dict = {}
        self.last_entries: list = []
        self.counters: dict = {}
        self._closed = False

        self.title = W.HTML(value="<b>mlxcache residency</b>")
        self.ram_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="RAM", bar_style="info")
        self.ram_label = W.HTML()
        self.ssd_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="SSD", bar_style="success")
        self.ssd_label = W.HTML()
        self.write_bar = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="writes", bar_style="warning")
        self.write_label = W.HTML()
        self.counters_html = W.HTML()
        self.entries_html = W.HTML()
        self.log_html = W.HTML()
        for w, cls in [
            (self.ram_label, "mlxc-ram"), (self.ssd_label, "mlxc-ssd"), (self.write_label, "mlxc-writes"),
            (self.counters_html, "mlxc-counters-box"), (self.entries_html, "mlxc-entries-box"),
            (self.log_html, "mlxc-log-box"), (self.ram_bar, "mlxc-ram-bar"), (self.ssd_bar, "mlxc-ssd-bar"),
            (self.write_bar, "mlxc-write-bar"),
        ]:
            w.add_class(cls)
        row = lambda a, b: W.HBox([a, b], layout=W.Layout(align_items="center"))  # noqa: E731
        super().__init__(
            children=[
                self.title,
                row(self.ram_bar, self.ram_label),
                row(self.ssd_bar, self.ssd_label),
                row(self.write_bar, self.write_label),
                self.counters_html,
                self.entries_html,
                self.log_html,
            ],
            **kwargs,
        )
        self.add_class("mlxc-dashboard")
        for ev in _snapshot(getattr(getattr(engine, "events", None), "recent", ())):
            if ev.get("type") in LOG_TYPES:
                self._log.append(dict(ev))
        self._unsubscribe = engine.events.subscribe(self._on_event)
        self.refresh()

    # --- events (any thread) ---

    def _on_event(self, event: dict) -> None:
        if self._closed:
            return
        with self._lock:
            self.events_seen += 1
            if event.get("type") in LOG_TYPES:
                self._log.append(dict(event))
            self._dirty = True
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
        with self._lock:
            log = list(self._log)
        try:
            stats = dict(self.engine.stats())
        except Exception:
            return
        self.light_refreshes += 1
        self.last_stats = stats
        self.counters = counters_from_stats(stats)
        self._render_bars(stats)
        self._set(self.counters_html, render_counters(self.counters))
        self._set(self.log_html, render_log(log))

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
        if not self._dirty:
            return
        wait = self._last_refresh + self.throttle_s - time.monotonic()
        if wait <= 0:
            self.refresh()
        elif not self._timer and self._call_later is not None:
            self._timer = True
            self._call_later(wait, self._timer_fired)

    def refresh(self) -> None:
        """Rebuild the whole view now from engine.stats() and engine.cache_entries().

        Owner thread, at a safe point (between cells; not from inside an
        engine callback: cache_entries() applies finished background work).
        From another thread it only queues a refresh."""
        if self._closed:
            return
        if threading.current_thread() is not self._owner:
            with self._lock:
                self._dirty = True
            self._request()
            return
        with self._lock:
            self._dirty = False
            log = list(self._log)
        self._last_refresh = self._last_light = time.monotonic()
        self.refreshes += 1
        eng = self.engine
        try:
            stats = dict(eng.stats())
        except Exception as exc:  # a closed engine, say
            self.title.value = f"<b>mlxcache residency</b> — <i>{esc(exc)}</i>"
            return
        entries = eng.cache_entries()
        self.last_stats, self.last_entries = stats, list(entries)
        self.counters = counters_from_stats(stats)
        self._render_bars(stats)
        self._set(self.counters_html, render_counters(self.counters))
        self._set(self.entries_html, render_entries(self.last_entries))
        self._set(self.log_html, render_log(log))
        if stats.get("pending_writes") and self._call_later is not None and not self._timer:
            # the writer reports progress by polling, not events
            self._timer = True
            self._dirty = True
            self._call_later(PENDING_POLL_S, self._timer_fired)

    @staticmethod
    def _set(widget, value) -> None:
        if widget.value != value:
            widget.value = value

    def _render_bars(self, s: dict) -> None:
        used, budget = s.get("ram_used_bytes") or 0, s.get("ram_budget_bytes")
        n = s.get("ram_entries") or 0
        self._bar(self.ram_bar, used, budget)
        self._set(
            self.ram_label,
            f"<span data-used='{used}'>{fmt_bytes(used)} of {fmt_bytes(budget) if budget else 'no budget'}"
            f" · {n} entr{'y' if n == 1 else 'ies'}</span>",
        )
        if not s.get("ssd_enabled", "ssd_bytes" in s):
            self._bar(self.ssd_bar, 0, 1)
            self._set(self.ssd_label, "<span>SSD tier off</span>")
        else:
            used, cap = s.get("ssd_bytes") or 0, s.get("ssd_budget_bytes")
            files = s.get("ssd_files") or 0
            self._bar(self.ssd_bar, used, cap)
            self._set(
                self.ssd_label,
                f"<span data-used='{used}'>{fmt_bytes(used)} of {fmt_bytes(cap) if cap else 'no cap'}"
                f" · {files} file{'' if files == 1 else 's'}</span>",
            )
        pending, pbytes = s.get("pending_writes") or 0, s.get("pending_write_bytes") or 0
        prog = (s.get("write_in_progress_bytes") or 0, s.get("write_in_progress_total") or 0)
        if prog[1]:
            self._bar(self.write_bar, prog[0], prog[1])
            cur = f" · writing {fmt_bytes(prog[0])} of {fmt_bytes(prog[1])}"
        else:
            self._bar(self.write_bar, 0, 1)
            cur = ""
        dirty, failed = s.get("dirty_entries") or 0, s.get("failed_entries") or 0
        extra = ""
        if dirty:
            db = s.get("dirty_bytes")
            extra += f" · {dirty} dirty" + (f" ({fmt_bytes(db)})" if db is not None else "")
        if failed:
            fb = s.get("failed_bytes")
            extra += f" · <span class='mlxc-state-failed'>{failed} failed" + (f" ({fmt_bytes(fb)})" if fb is not None else "") + "</span>"
        self._set(
            self.write_label,
            f"<span data-pending='{pending}' data-failed='{failed}'>{pending} pending ({fmt_bytes(pbytes)}){cur}{extra}</span>",
        )

    def _bar(self, bar, value, maximum) -> None:
        maximum = float(maximum) if maximum else max(1.0, float(value or 0))
        value = min(float(value or 0), maximum)
        if bar.max != maximum:
            if maximum < bar.value:
                bar.value = 0.0
            bar.max = maximum
        if bar.value != value:
            bar.value = value
        if bar is self.ram_bar:
            style = "danger" if value >= maximum and maximum > 1 else "info"
            if bar.bar_style != style:
                bar.bar_style = style

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
