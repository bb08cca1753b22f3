"""Plain-text formatting shared by the widgets and the magics (no Jupyter, no MLX).

Bytes, seconds, ages, counts, HTML escaping, one-line previews, progress lines.
Public: the kernel's magics import it too.
"""

from __future__ import annotations

import html
import time

from mlxcache_kernel.engine.metrics import fmt_bytes  # (the engine's messages say bytes the same way)


def fmt_seconds(s) -> str:
    if s is None:
        return "–"
    s = float(s)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


# (below this many seconds, count in units of this many seconds, unit)
_AGO_UNITS = ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h"), (float("inf"), 86400, "d"))


def fmt_ago(t, now: float | None = None) -> str:
    if not t:
        return "–"
    d = max(0.0, (time.time() if now is None else now) - float(t))
    if d < 1:
        return "now"
    _, seconds, unit = next(u for u in _AGO_UNITS if d < u[0])
    return f"{d / seconds:.0f}{unit} ago"


def fmt_count(n) -> str:
    if n is None:
        return "–"
    if isinstance(n, float) and not n.is_integer():
        return f"{n:,.2f}"
    return f"{int(n):,}"


def esc(s) -> str:
    return html.escape("" if s is None else str(s), quote=True)


def preview_text(s, limit: int = 60) -> str:
    """One line, control characters made visible, truncated in the middle."""
    if s is None:
        return ""
    s = str(s).replace("\r", "").replace("\n", "⏎").replace("\t", " ")
    s = "".join(ch if ch.isprintable() else "·" for ch in s)
    if len(s) > limit:
        half = (limit - 1) // 2
        s = s[:half] + "…" + s[-(limit - 1 - half):]
    return s


def progress_line(phase: str, done: int, total: int, rate: float | None, eta: float | None) -> str:
    pct = (100.0 * done / total) if total else 0.0
    parts = [f"{phase} {done:,}/{total:,} tokens ({pct:.0f}%)"]
    if rate:
        parts.append(f"{rate:,.0f} tok/s")
    if eta is not None and done < total:
        parts.append(f"ETA {fmt_seconds(eta)}")
    return " · ".join(parts)
