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
    "ENTRY_COLUMNS", "checkpoint_row", "columns_of", "entry_row", "fmt_s", "format_bytes", "kv_row",
    "setting_lines", "show_table", "stat_lines",
]

# %cache ls: kind is "prefix" (a prompt's KV) or "object" (Engine.objects, @memo); ram, kv and file
# are the entry's resident footprint, its KV state's (an object's value's) bytes and its SSD file's
# size (– where it has none).
ENTRY_COLUMNS = ["model", "tokens", "tier", "write_state", "ram", "kv", "file", "borrowers", "sessions", "pinned",
                 "hits", "last_used", "kind", "preview"]


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


def entry_row(e: dict) -> dict:
    """A ``cache_entries()`` row for ENTRY_COLUMNS."""
    row = dict(e)
    for col in ("ram", "kv", "file"):
        row[col] = format_bytes(e.get(f"{col}_bytes"))
    for k in ("sessions", "pinned"):
        if isinstance(row.get(k), (list, tuple)):
            row[k] = ",".join(map(str, row[k]))
    if isinstance(row.get("last_used"), (int, float)):
        row["last_used"] = time.strftime("%H:%M:%S", time.localtime(row["last_used"]))
    if isinstance(row.get("preview"), str):
        row["preview"] = row["preview"].replace("\n", "⏎")[:60]
    return row


def kv_row(r: dict) -> dict:
    """A ``kv_info()`` row: floats to 4 digits, shapes as AxB, bytes readable."""
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


def stat_lines(stats: dict) -> list[str]:
    """``%cache stats``: one aligned ``key  value`` line per counter."""
    width = max(len(k) for k in stats)
    lines = []
    for k, v in stats.items():
        if isinstance(v, bool) or v is None:
            shown = v
        elif k.endswith("_bytes") or k == "bytes_written":
            shown = f"{format_bytes(v)} ({v})"
        elif isinstance(v, float):
            shown = f"{v:.3f}"
        else:
            shown = v
        lines.append(f"{k.ljust(width)}  {shown}")
    return lines


def setting_lines(summary: dict) -> list[str]:
    """``%cache config``: ``key: value``, byte sizes readable."""
    return [f"{k}: {format_bytes(v) if k.endswith('_bytes') and isinstance(v, int) else v}"
            for k, v in summary.items()]
