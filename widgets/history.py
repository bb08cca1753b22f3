"""The dashboard's history: RAM and SSD bytes, hits and misses over time, as a
small inline SVG (no front-end build, no plotting library), and the memory
line with the pressure marks.

`History.add(stats)` keeps one sample per refresh (a bounded ring);
`render()` draws the samples; both are plain functions of `engine.stats()`.
"""

from __future__ import annotations

import time
from collections import deque

from .format import esc, fmt_bytes

SAMPLES = 120
W, H = 360, 60


class History:
    def __init__(self, size: int = SAMPLES):
        self.samples: deque = deque(maxlen=size)

    def add(self, s: dict, now: float | None = None) -> None:
        sample = (now or time.time(), s.get("ram_used_bytes") or 0, s.get("ssd_bytes") or 0,
                  s.get("hits") or 0, s.get("misses") or 0)
        if not self.samples or sample[1:] != self.samples[-1][1:]:
            self.samples.append(sample)

    def render(self) -> str:
        if len(self.samples) < 2:
            return "<div class='mlxc-history mlxc-empty'>history: waiting for activity</div>"
        rows = list(self.samples)
        lines = [
            _polyline([r[1] for r in rows], "#0b8793", "RAM"),
            _polyline([r[2] for r in rows], "#388e3c", "SSD"),
        ]
        hits = [b[3] - a[3] for a, b in zip(rows, rows[1:])]
        misses = [b[4] - a[4] for a, b in zip(rows, rows[1:])]
        bars, step = [], W / max(len(hits), 1)
        top = max(hits + misses + [1])
        for i, (h, m) in enumerate(zip(hits, misses)):
            x = i * step
            if h:
                bars.append(f"<rect x='{x:.1f}' y='{H - 12 * h / top:.1f}' width='{max(step / 2, 1):.1f}' "
                            f"height='{12 * h / top:.1f}' fill='#1565c0'><title>{h} hits</title></rect>")
            if m:
                bars.append(f"<rect x='{x + step / 2:.1f}' y='{H - 12 * m / top:.1f}' width='{max(step / 2, 1):.1f}' "
                            f"height='{12 * m / top:.1f}' fill='#c62828'><title>{m} misses</title></rect>")
        peak = max(max(r[1], r[2]) for r in rows)
        return (f"<div class='mlxc-history'><svg width='{W}' height='{H}' viewBox='0 0 {W} {H}' "
                f"data-samples='{len(rows)}'>{''.join(lines)}{''.join(bars)}</svg>"
                f"<span class='mlxc-legend'> <b style='color:#0b8793'>RAM</b> / <b style='color:#388e3c'>SSD</b> "
                f"bytes (peak {esc(fmt_bytes(peak))}), <b style='color:#1565c0'>hits</b> / "
                f"<b style='color:#c62828'>misses</b></span></div>")


def _polyline(values: list, color: str, name: str) -> str:
    top = max(values) or 1
    step = W / max(len(values) - 1, 1)
    points = " ".join(f"{i * step:.1f},{(H - 14) * (1 - v / top) + 1:.1f}" for i, v in enumerate(values))
    return f"<polyline points='{points}' fill='none' stroke='{color}' stroke-width='1.5'><title>{name}</title></polyline>"


def memory_label(s: dict) -> str:
    """Working set against the pressure marks (None until the first reading)."""
    working, high, low = s.get("memory_working_bytes"), s.get("memory_high_water_bytes"), s.get("memory_low_water_bytes")
    if working is None or not high:
        return "<span class='mlxc-memory'>memory: not measured yet</span>"
    state = " · <b class='mlxc-state-failed'>over the high-water mark</b>" if working > high else ""
    return (f"<span class='mlxc-memory' data-working='{working}' data-high='{high}'>memory: {fmt_bytes(working)} "
            f"working set · reclaim past {fmt_bytes(high)} down to {fmt_bytes(low)}"
            f" · {s.get('pressure_reclaims') or 0} reclaims{state}</span>")
