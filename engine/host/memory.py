"""Memory the kernel really has: measured, not assumed.

A fixed byte budget ignores the model's weights, the live generation's KV
and every other process on the machine. The pressure guard reads the working
set (process RSS, or MLX's active plus cached memory where that is larger)
and the memory the machine still has available; what the kernel may use is
the sum. Past the high-water mark (default 85% of that) it demotes cache
entries, least valuable first, until the working set is back under the
low-water mark. Persist-before-evict still holds: an entry whose SSD copy is
not committed is not dropped (its write is queued, and the writer stops
yielding to generation while the pressure lasts).

Checked at each lookup, after prefill, and every `DECODE_CHECK_EVERY` decode
steps; a reading is psutil's: this process's resident set size now and the
memory the machine has available (Linux: MemAvailable; macOS: free and
inactive pages), a few small reads of the OS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import psutil

from .system import physical_memory

DECODE_CHECK_EVERY = 64


def default_ram_budget() -> int:
    """A quarter of physical memory (for a fixed budget; `ram_budget_bytes=None` adapts instead)."""
    mem = physical_memory()
    return int(mem * 0.25) if mem else 4 << 30


def ram_budget(configured: int | None) -> int | None:
    """The RAM tier's budget: the configured one; unset, None (the pressure guard adapts) where
    the OS says how much memory there is, else a fixed default_ram_budget()."""
    if configured is not None:
        return configured
    try:
        read_memory()
    except (psutil.Error, OSError):
        return default_ram_budget()
    return None


@dataclass(frozen=True)
class MemoryReading:
    working: int  # bytes this process holds
    available: int  # bytes the machine could still give it

    @property
    def may_use(self) -> int:
        return self.working + self.available


def read_memory() -> MemoryReading:
    import mlx.core as mx

    rss = psutil.Process().memory_info().rss
    mlx_bytes = int(mx.get_active_memory()) + int(mx.get_cache_memory()) if hasattr(mx, "get_active_memory") else 0
    working = max(rss, mlx_bytes)
    return MemoryReading(working, psutil.virtual_memory().available)


class PressureGuard:
    def __init__(self, reclaim: Callable[[int, str], int], *, high: float = 0.85, low: float = 0.75,
                 reader: Callable[[], MemoryReading] = read_memory, emit: Callable[..., object] | None = None):
        if not 0 < low < high <= 1:
            raise ValueError(f"memory marks must satisfy 0 < low < high <= 1, got low={low}, high={high}")
        self.reclaim, self.high, self.low, self.reader = reclaim, high, low, reader
        self._emit = emit or (lambda *a, **k: None)
        self.last: MemoryReading | None = None
        self.counters = {"pressure_checks": 0, "pressure_reclaims": 0, "pressure_freed_bytes": 0}
        self.active = False  # over the high-water mark at the last check (the writer stops yielding)

    def read(self) -> MemoryReading | None:
        """A new reading, kept as `last`; None where the OS does not say (then ram_budget is fixed)."""
        try:
            self.last = self.reader()
        except (psutil.Error, OSError):
            self.last = None
        return self.last

    def check(self, where: str) -> int:
        """Reclaim down to the low-water mark if over the high-water mark; the bytes freed."""
        r = self.read()
        if r is None:
            return 0
        self.counters["pressure_checks"] += 1
        self.active = r.working > self.high * r.may_use
        if not self.active:
            return 0
        want = r.working - int(self.low * r.may_use)
        freed = self.reclaim(want, where)
        self.counters["pressure_reclaims"] += 1
        self.counters["pressure_freed_bytes"] += freed
        self._emit("pressure", where=where, working=r.working, limit=r.may_use, wanted=want, freed=freed)
        return freed

    def stats(self) -> dict:
        r = self.last
        return {
            **self.counters,
            "memory_working_bytes": r.working if r else None,
            "memory_available_bytes": r.available if r else None,
            "memory_high_water_bytes": int(self.high * r.may_use) if r else None,
            "memory_low_water_bytes": int(self.low * r.may_use) if r else None,
        }
