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

It says what it does once per change of state, not at every check: one
"pressure" event when it reclaims, when memory is short with nothing left to
let go (`note` says so in words until it is not), and when the pressure ends.
Read while no generation runs, it also sets `room`: the bytes the cache's
entries may hold under the high-water mark beside everything else the process
holds. An entry larger than that is kept on SSD only (cache/ram.py `cap`), instead
of being published, reclaimed at the next check and restored for the next
cell, over and over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import psutil

from ..metrics import fmt_bytes
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
    pool: int = 0  # of `working`, freed buffers MLX keeps for reuse (mx.clear_cache gives them back)

    @property
    def may_use(self) -> int:
        return self.working + self.available


def read_memory() -> MemoryReading:
    import mlx.core as mx

    rss = psutil.Process().memory_info().rss
    pool = int(mx.get_cache_memory()) if hasattr(mx, "get_cache_memory") else 0
    mlx_bytes = int(mx.get_active_memory()) + pool if hasattr(mx, "get_active_memory") else 0
    working = max(rss, mlx_bytes)
    return MemoryReading(working, psutil.virtual_memory().available, min(pool, working))


class PressureGuard:
    def __init__(self, reclaim: Callable[[int, str], int], *, high: float = 0.85, low: float = 0.75,
                 reader: Callable[[], MemoryReading] = read_memory, emit: Callable[..., object] | None = None,
                 held: Callable[[], int | None] = lambda: None):
        """reclaim(bytes, where): let cache entries go, returns the bytes freed; held(): the bytes the
        cache's entries hold, None while a generation runs (its KV is in a reading then, in no entry)."""
        if not 0 < low < high <= 1:
            raise ValueError(f"memory marks must satisfy 0 < low < high <= 1, got low={low}, high={high}")
        self.reclaim, self.high, self.low, self.reader, self.held = reclaim, high, low, reader, held
        self._emit = emit or (lambda *a, **k: None)
        self.last: MemoryReading | None = None
        self.counters = {"pressure_checks": 0, "pressure_reclaims": 0, "pressure_freed_bytes": 0, "pressure_events": 0}
        self.active = False  # over the high-water mark at the last check (the writer stops yielding)
        self.state = "calm"  # "calm", "reclaimed" (entries let go) or "short" (over, nothing left to let go)
        self.note: str | None = None  # while "short": what the user should know, in words
        self.room: int | None = None  # bytes the cache's entries may hold under the high-water mark (None: unknown)

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
        high = int(self.high * r.may_use)
        held = self.held()
        if held is not None:  # what the rest of the process holds, MLX's free pool aside, leaves the entries this
            self.room = high - (r.working - held - r.pool)
        self.active = r.working > high
        if not self.active:
            self._enter("calm", where, r)
            return 0
        want = r.working - int(self.low * r.may_use)
        freed = self.reclaim(want, where)
        if freed:
            self.counters["pressure_reclaims"] += 1
            self.counters["pressure_freed_bytes"] += freed
        self._enter("reclaimed" if freed else "short", where, r, wanted=want, freed=freed)
        return freed

    def _enter(self, state: str, where: str, r: MemoryReading, **fields) -> None:
        """One event per change of state (each reclaim that let entries go is one); none while it stays."""
        if state == self.state and state != "reclaimed":
            return
        self.state = state
        self.note = (f"memory is short: this process holds {fmt_bytes(r.working)}, past the high-water mark "
                     f"({fmt_bytes(self.high * r.may_use)} of the {fmt_bytes(r.may_use)} it may use), and the cache "
                     "has nothing more it may let go (what a generation holds or borrows, and entries not yet on "
                     "SSD, stay)") if state == "short" else None
        self.counters["pressure_events"] += 1
        self._emit("pressure", state=state, where=where, working=r.working, limit=r.may_use,
                   high_water=int(self.high * r.may_use), note=self.note, **fields)

    def stats(self) -> dict:
        r = self.last
        return {
            **self.counters,
            "memory_working_bytes": r.working if r else None,
            "memory_available_bytes": r.available if r else None,
            "memory_high_water_bytes": int(self.high * r.may_use) if r else None,
            "memory_low_water_bytes": int(self.low * r.may_use) if r else None,
            "memory_room_bytes": self.room,
            "memory_note": self.note,
        }
