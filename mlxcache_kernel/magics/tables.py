"""How the magics show plain data: text tables (with an HTML twin for rich
front ends) and the per-value formatting of their rows.

Pure functions of engine rows and dicts; nothing here calls the engine.
"""

from __future__ import annotations

import html
import time

from IPython.display import display

from mlxcache_kernel.widgets.format import fmt_bytes as format_bytes

__all__ = [
    "ENTRY_COLUMNS", "checkpoint_row", "columns_of", "describe_checkpoint", "entry_row", "fmt_s", "format_bytes", "kv_row",
    "setting_lines", "show_table", "stat_lines",
]

# %cache ls: kind is "prefix" (a prompt's KV) or "object" (Engine.objects, @memo); ram is what only this
# entry holds in RAM and shared what it holds with others (one document under several questions: in
# each of their rows, held once), kv its KV state's (an object's value's) bytes, file its SSD manifest
# with every block it names (blocks shared with other files in each of their rows) (– where none).
ENTRY_COLUMNS = ["model", "tokens", "tier", "write_state", "ram", "shared", "kv", "file", "borrowers", "sessions",
                 "pinned", "hits", "last_used", "kind", "preview"]


def fmt_s(x) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def show_table(rows: list[dict], columns: list[str], *, empty: str = "(none)") -> None:
    """Display rows as a plain-text table (with an HTML rendering for rich front ends)."""
    if not rows:
        print(empty)
        return
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    text = "\n".join(lines)
    head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(v)}</td>" for v in row) + "</tr>" for row in cells
    )
    display({"text/plain": text, "text/html": f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"},
            raw=True)


def columns_of(rows: list[dict]) -> list[str]:
    """Every key of the rows, in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in r))


def checkpoint_row(c: dict) -> dict:
    """A ``checkpoint_list()`` summary with sizes and times made readable."""
    row = dict(c)
    for k in list(row):
        if k.endswith("bytes"):
            row[k] = format_bytes(row[k])
        elif k in ("created", "saved", "last_used") and isinstance(row[k], (int, float)):
            row[k] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row[k]))
    return row


def describe_checkpoint(info) -> str:
    """`` (12 tokens, 1.2 MiB KV, session 's')`` from a checkpoint summary."""
    if not isinstance(info, dict):
        return ""
    bits = []
    if info.get("tokens") is not None:
        bits.append(f"{info['tokens']} tokens")
    if info.get("kv_bytes") is not None:
        bits.append(f"{format_bytes(info['kv_bytes'])} KV")
    if info.get("session"):
        bits.append(f"session {info['session']!r}")
    return f" ({', '.join(bits)})" if bits else ""


def entry_row(e: dict) -> dict:
    """An ``admin.entries()`` row for ENTRY_COLUMNS."""
    row = dict(e)
    for col in ("kv", "file"):
        row[col] = format_bytes(e.get(f"{col}_bytes"))
    own = e.get("ram_own_bytes", e.get("ram_bytes"))
    row["ram"] = format_bytes(own)
    row["shared"] = format_bytes(e["ram_bytes"] - own if e.get("ram_bytes") is not None and own is not None else None)
    for k in ("sessions", "pinned"):
        if isinstance(row.get(k), (list, tuple)):
            row[k] = ",".join(map(str, row[k]))
    if isinstance(row.get("last_used"), (int, float)):
        row["last_used"] = time.strftime("%H:%M:%S", time.localtime(row["last_used"]))
    if isinstance(row.get("preview"), str):
        row["preview"] = row["preview"].replace("\n", "⏎")[:60]
    return row


def kv_row(r: dict) -> dict:
    """A ``kv.info()`` row: floats to 4 digits, shapes as AxB, bytes readable."""
    row = dict(r)
    for k, v in list(row.items()):
        if isinstance(v, float):
            row[k] = f"{v:.4g}"
        elif k == "bytes":
            row[k] = format_bytes(v)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
            row[k] = "x".join(map(str, v))
        elif isinstance(v, (list, tuple)):
            row[k] = " ".join("x".join(map(str, x)) if isinstance(x, (list, tuple)) else str(x) for x in v)
    return row


# %cache stats: every key of Engine.stats() in one group, by its prefix (the first match; "engine" takes
# the rest). Order: what a reader looks for first.
STAT_GROUPS = (
    ("engine", ("blas", "models", "default_model", "sessions", "cache_dir", "ssd_disabled_reason", "cache_links",
                "engine_")),
    ("RAM", ("ram_", "memory_", "pressure_", "hits", "misses", "evictions", "supersessions", "oversized",
             "handovers", "demotions")),
    ("SSD", ("ssd_", "prefetch")),
    ("writes", ("write", "pending_", "dirty_", "failed_", "bytes_written", "inflight_", "dropped_unwritable")),
    ("remote", ("remote_",)),
    ("objects", ("object_",)),
    ("vision", ("vision_",)),
)


def stat_group(key: str) -> str:
    return next((g for g, prefixes in STAT_GROUPS if key.startswith(prefixes)), "engine")


def _stat_value(k: str, v):
    if v is None:  # a budget not set is no cap; anything else not measured yet
        return "no cap" if k.endswith("budget_bytes") else "–"
    if isinstance(v, bool):
        return v
    if isinstance(v, dict):  # cache_links: path -> what it is
        return "; ".join(f"{p} is {why}" for p, why in v.items()) or "none"
    if k.endswith("_bytes") or k == "bytes_written":
        return format_bytes(v)
    if isinstance(v, float):
        return f"{v:.3f}"
    return v


ALWAYS_SHOWN = {"pending_writes"}  # zero is news here: every write is durable


def stat_lines(stats: dict, every: bool = False) -> list[str]:
    """``%cache stats``: the counters in groups (engine, RAM, SSD, writes, remote, objects, vision), one
    aligned ``key  value`` line each. Unless `every`, a group with nothing but zeros is left out and
    so is each zero counter, and a last line says what was left out (``--all`` shows it)."""
    groups: dict = {g: [] for g, _ in STAT_GROUPS}
    for k, v in stats.items():
        groups[stat_group(k)].append((k, v))
    width = max((len(k) for k in stats), default=0)
    lines, empty, hidden = [], [], 0
    for group, items in groups.items():
        shown = items if every else [(k, v) for k, v in items if v or group == "engine" or k in ALWAYS_SHOWN]
        if not shown:
            empty += [group] if items else []
            continue
        hidden += len(items) - len(shown)
        lines.append(f"{group}:")
        lines += [f"  {k.ljust(width)}  {_stat_value(k, v)}" for k, v in shown]
    if empty or hidden:
        left = ([f"{', '.join(empty)}: nothing yet"] if empty else []) + ([f"{hidden} zero counters"] if hidden else [])
        lines.append(f"({' · '.join(left)} not shown: %cache stats --all shows every counter)")
    return lines


def setting_lines(summary: dict) -> list[str]:
    """``%cache config``: ``key: value``, byte sizes readable."""
    return [f"{k}: {format_bytes(v) if k.endswith('_bytes') and isinstance(v, int) else v}"
            for k, v in summary.items()]
