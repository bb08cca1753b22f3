"""How the residency dashboard looks: HTML for its counters, entries table,
event log and the labels beside its bars, from plain dicts (`engine.stats()`,
`engine.admin.entries()` rows, event records).

Pure functions: no widgets, no engine calls.
"""

from __future__ import annotations

import shutil
import time

from .dashboard_state import COUNTERS
from .format import esc, fmt_ago, fmt_bytes, fmt_count, fmt_seconds, preview_text

__all__ = ["CSS", "GONE_NOTE", "prefetch_label", "render_counters", "render_entries", "render_log", "ram_gauge", "ram_label",
           "remote_label", "ssd_label", "ssd_enabled", "write_label", "write_progress"]

MAX_ROWS = 50

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
.mlxc-dashboard-gone {display: none;}
</style>
"""

# Shown under %dashboard's widget; hidden by the widget's own stylesheet (CSS above) while its view is
# live. A kernel restart disposes the view (the output went blank) and a reopened notebook has no model:
# the style goes with the view and this note says what to do.
GONE_NOTE = ("<div class='mlxc-dashboard-gone' style='color:#a15c00'>"
             "dashboard not live (kernel restarted): run %dashboard again</div>")


def render_counters(c: dict) -> str:
    items = []
    for label, key, _, kind in COUNTERS:
        v = c.get(key)
        if kind == "r":
            text = "–" if v is None else f"{v:.0%}"
        else:
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
    """The entries table; ram / kv / file are the row's ram_bytes, kv_bytes and file_bytes."""
    if not entries:
        return ("<div class='mlxc-h'>Entries</div><div class='mlxc-entries mlxc-empty'>no cached prefixes or objects "
                "yet</div>")
    rows = sorted(entries, key=lambda e: e.get("last_used") or 0, reverse=True)
    head = (
        "<tr><th>prefix or object</th><th class='num'>tokens</th><th class='num'>ram</th><th class='num'>kv</th>"
        "<th class='num'>file</th><th>tier</th><th>write</th><th class='num'>borrowers</th>"
        "<th>session / pinned</th><th class='num'>hits</th><th>last use</th></tr>"
    )
    body = []
    for e in rows[:MAX_ROWS]:
        state = e.get("write_state") or "none"
        sizes = "".join(f"<td class='num'>{esc(fmt_bytes(e.get(k)))}</td>" for k in ("ram_bytes", "kv_bytes", "file_bytes"))
        kind = e.get("kind") or "prefix"
        preview = ("object · " if kind == "object" else "") + str(e.get("preview") or "")
        body.append(
            f"<tr class='mlxc-entry mlxc-kind-{esc(kind)}'>"
            f"<td class='mlxc-preview' title='{esc(preview_text(preview, 400))}'>{esc(preview_text(preview, 90))}</td>"
            f"<td class='num'>{fmt_count(e.get('tokens'))}</td>{sizes}"
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
    nbytes = ev.get("nbytes")
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


NEAR_WATER = 0.9  # the RAM bar warns from this fraction of what it is drawn against


def ram_gauge(s: dict) -> tuple[float, float, str]:
    """(value, maximum, style) of the RAM bar. A fixed budget: the cache's bytes against it. The
    adaptive budget (none): the kernel's working set against the high-water mark, the memory the
    pressure guard lets it use before it demotes entries. Calm ("info") until NEAR_WATER of it,
    "warning" from there, "danger" past it."""
    budget = s.get("ram_budget_bytes")
    if budget:
        value, maximum = s.get("ram_used_bytes") or 0, budget
    else:
        value, maximum = s.get("memory_working_bytes") or 0, s.get("memory_high_water_bytes") or 0
    if not maximum:
        return 0.0, 1.0, "info"  # not measured yet
    style = "danger" if value >= maximum else "warning" if value >= NEAR_WATER * maximum else "info"
    return float(min(value, maximum)), float(maximum), style


def ram_label(s: dict) -> str:
    used, budget, n = s.get("ram_used_bytes") or 0, s.get("ram_budget_bytes"), s.get("ram_entries") or 0
    objects = s.get("object_ram_entries") or 0
    of_which = f" ({objects} object{'' if objects == 1 else 's'}, {fmt_bytes(s.get('object_ram_bytes'))})" if objects else ""
    entries = f"{n} entr{'y' if n == 1 else 'ies'}{of_which}"
    if budget:
        return f"<span data-used='{used}' data-objects='{objects}'>{fmt_bytes(used)} of {fmt_bytes(budget)} · {entries}</span>"
    working, high = s.get("memory_working_bytes"), s.get("memory_high_water_bytes")
    against = (f" · kernel {fmt_bytes(working)} of the {fmt_bytes(high)} the memory guard allows" if working and high
               else " · memory not measured yet")
    return f"<span data-used='{used}' data-objects='{objects}'>{fmt_bytes(used)} cached{against} · {entries}</span>"


def disk_free(path) -> int:
    """Bytes free on the disk holding `path` (0 when it cannot be read)."""
    try:
        return shutil.disk_usage(path).free if path else 0
    except OSError:
        return 0


def ssd_label(s: dict) -> str:
    if not ssd_enabled(s):
        why = s.get("ssd_disabled_reason")
        return f"<span class='mlxc-state-failed'>SSD tier off: {esc(why)}</span>" if why else "<span>SSD tier off</span>"
    used, cap, files = s.get("ssd_bytes") or 0, s.get("ssd_budget_bytes"), s.get("ssd_files") or 0
    procs = s.get("ssd_processes") or 1
    shared = ""
    if procs > 1:  # other kernels on this directory, and what they still have to write
        shared = f" · shared by {procs} processes ({s.get('ssd_processes_pending_writes') or 0} writes pending)"
    blocks, saved = s.get("ssd_blocks") or 0, s.get("ssd_bytes_deduplicated") or 0
    dedup = f" · {blocks} shared block{'' if blocks == 1 else 's'}" if blocks else ""
    if saved:  # what content addressing did not have to write again
        dedup += f" · {fmt_bytes(saved)} not rewritten (deduplicated)"
    room = fmt_bytes(cap) if cap else f"no cap ({fmt_bytes(disk_free(s.get('cache_dir')))} free on disk)"
    return (
        f"<span data-used='{used}' data-processes='{procs}' data-deduplicated='{saved}'>{fmt_bytes(used)} unique of "
        f"{room} · {files} checkpoint{'' if files == 1 else 's'}{dedup}{shared}</span>"
    )


REMOTE_REJECTED = (("remote_mac_rejected", "forged or foreign"), ("remote_wrong_size", "wrong size"),
                   ("remote_bad_blocks", "bad blocks"), ("remote_malformed", "malformed"), ("remote_stale", "stale"),
                   ("remote_deadline_missed", "past their deadline"))


def remote_label(s: dict) -> str:
    """The remote tier's line: where (credentials removed), whether it is authenticated, its state,
    hits, what it rejected, and publications; empty when off."""
    url = s.get("remote_url")
    if not url:
        return ""
    state = s.get("remote_state") or "ok"
    cls = "mlxc-state-failed" if state != "ok" else ""
    err = f" · last error: {esc(s['remote_last_error'])}" if state != "ok" and s.get("remote_last_error") else ""
    auth = s.get("remote_auth") or ""
    open_ = auth.startswith("UNAUTHENTICATED")
    flag = " <span class='mlxc-state-failed' data-auth='open'>UNAUTHENTICATED</span>" if open_ else ""
    rejected = [f"{s[k]} {what}" for k, what in REMOTE_REJECTED if s.get(k)]
    rejected_text = f" · rejected: {esc(', '.join(rejected))}" if rejected else ""
    return (
        f"<div class='mlxc-remote' data-state='{esc(state)}'>remote {esc(url)}{flag}: <span class='{cls}'>"
        f"{esc(state)}</span> · {s.get('remote_hits') or 0} hits ({s.get('remote_tokens') or 0} tokens) · "
        f"{s.get('remote_misses') or 0} misses{rejected_text} · {s.get('remote_blocks_uploaded') or 0} blocks "
        f"uploaded, {s.get('remote_publish_pending') or 0} pending{err}</div>"
    )


def ssd_enabled(s: dict) -> bool:
    return bool(s.get("ssd_enabled", "ssd_bytes" in s))


def write_progress(s: dict) -> tuple[int, int]:
    """(bytes written, bytes in total) of the write in progress; total 0 when none is."""
    return s.get("write_in_progress_bytes") or 0, s.get("write_in_progress_total") or 0


def write_label(s: dict) -> str:
    pending, pbytes = s.get("pending_writes") or 0, s.get("pending_write_bytes") or 0
    done, total = write_progress(s)
    cur = f" · writing {fmt_bytes(done)} of {fmt_bytes(total)}" if total else ""
    dirty, failed = s.get("dirty_entries") or 0, s.get("failed_entries") or 0
    extra = ""
    if dirty:
        db = s.get("dirty_bytes")
        extra += f" · {dirty} dirty" + (f" ({fmt_bytes(db)})" if db is not None else "")
    if failed:
        fb = s.get("failed_bytes")
        extra += f" · <span class='mlxc-state-failed'>{failed} failed" + (f" ({fmt_bytes(fb)})" if fb is not None else "") + "</span>"
    if s.get("write_error"):
        extra += f" · <span class='mlxc-state-failed' title='{esc(s['write_error'])}'>writes failing: " \
                 f"{esc(preview_text(s['write_error'], 80))}</span>"
    return f"<span data-pending='{pending}' data-failed='{failed}'>{pending} pending ({fmt_bytes(pbytes)}){cur}{extra}</span>"


def prefetch_label(s: dict) -> str:
    """Background reads from SSD (prefetches, named checkpoints, sessions): in progress and done."""
    busy, done = s.get("prefetches_in_progress") or 0, s.get("prefetches_completed") or 0
    text = f"{busy} in progress ({fmt_bytes(s.get('prefetch_in_progress_bytes') or 0)})" if busy else "none in progress"
    text += f" · {done} done ({fmt_bytes(s.get('prefetch_bytes') or 0)})"
    for key, what in (("prefetches_dropped", "dropped"), ("prefetch_waits", "waited for by a lookup")):
        if s.get(key):
            text += f" · {fmt_count(s[key])} {what}"
    if s.get("prefetches_failed"):
        text += f" · <span class='mlxc-state-failed'>{fmt_count(s['prefetches_failed'])} failed</span>"
    return f"<span data-in-progress='{busy}' data-done='{done}'>prefetch: {text}</span>"
