"""The durability part of the tiered cache: RAM entries' way to SSD and what they may do meanwhile.

Each RAM entry has a `WriteState`. Publication queues a write (write-behind);
the writer thread's completions are applied on the owner thread (`poll`).
Persist before demotion: an entry leaves RAM only when a committed file
covers it; an unwritten victim gets a write queued and stays (the budget is
soft meanwhile). Failed writes (a full disk, a read-only directory) retry
with exponential backoff; while they keep failing, RAM over budget lets the
unwritable entries go, so memory stays bounded, and the error shows in the
stats. A file another process deleted makes the entries it covered dirty
again: persist-before-evict holds across processes. Named checkpoints pin
their files in the shared catalogue.

`Durability` is the RAM tier's `ResidencyRules` (entry.py): the RAM tier asks
it before an entry leaves, is superseded or hands its buffers over. Without
an SSD tier (`store` None) it answers as RAM alone would.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Callable, Sequence

from ..kv.checkpoint import Checkpoint
from .pins import CatalogPins
from .entry import Entry
from .ram import RamTier
from .ssd.store import CheckpointStore
from .ssd.writer import CheckpointWriter, WriteCancelled, WriteJob

RETRY_FAILED_AFTER_S = 5.0  # first retry of a failed write; doubles per failure
RETRY_MAX_S = 300.0
ABORT_WAIT_S = 0.05  # a rerun waits this long at most for the write it stops to reach a pause point
# In-flight checkpoints may keep the disk (and a core) busy this share of the
# time at most: after a write of d seconds the next capture waits (1/share - 1) d.
INFLIGHT_DUTY = 0.1
COUNTERS = ("ssd_hits", "ssd_tokens", "ssd_restore_failures", "demotions", "writes_queued", "writes_committed",
            "writes_failed", "bytes_written", "inflight_queued", "inflight_replaced", "dropped_unwritable",
            "writes_cancelled", "writes_skipped_stored")


class WriteState(str, Enum):
    """Where a RAM entry's SSD copy stands (a str, so it prints and compares as its value)."""

    NONE = "none"  # no SSD tier
    DIRTY = "dirty"  # not written yet
    PENDING = "pending"  # queued or being written
    COMMITTED = "committed"  # durable on SSD
    FAILED = "failed"  # the last write failed; retried later


UNWRITTEN = (None, WriteState.NONE, WriteState.DIRTY, WriteState.FAILED)


class Durability:
    def __init__(self, ram: RamTier, store: CheckpointStore | None, writer: CheckpointWriter | None, *,
                 counters: dict, emit: Callable[..., object], write_behind: bool, idle_demote_s: float | None):
        self.ram, self.store, self.writer = ram, store, writer  # (store and writer: None without SSD)
        self.counters, self._emit = counters, emit
        self.write_behind = write_behind
        self.idle_demote_s = idle_demote_s
        self.identities: dict[str, dict] = {}  # namespace -> the identity its files carry
        self.counters.update(dict.fromkeys(COUNTERS, 0))
        self._failures: dict[tuple, tuple[float, int]] = {}  # (ns, tokens) -> (last failure, count)
        self._vanished: list[tuple] = []  # (ns, tokens) of files other processes deleted (any thread appends)
        self.write_error: str | None = None  # the latest write failure, until a write succeeds again
        self._error_kind: tuple | None = None
        self.pins = CatalogPins(store)  # its source (the named records): TieredPromptCache.follow_pins
        self._rebuilds_seen = 0
        self._inflight_last = (0.0, 0.0)  # (when, seconds) of the last in-flight write applied
        self.held: Callable[[str, tuple], bool] = lambda ns, tokens: False  # remote state on probation (remote/verify.py)

    def file_removed(self, ns: str, tokens: tuple) -> None:
        """Another process deleted a file (the store tells, from any thread); applied in poll()."""
        self._vanished.append((ns, tokens))

    # --- ResidencyRules (the RAM tier asks) ---

    def may_drop(self, entry: Entry, reason: str) -> bool:
        if self.store is None or self.held(entry.ns, entry.tokens):  # (held: never written, may go unverified)
            return not entry.pinned
        if self.store.has_durable_prefix(entry.tokens, entry.ns):
            entry.write_state = WriteState.COMMITTED
            self.counters["demotions"] += 1
            self._emit("demote", ns=entry.ns, tokens=len(entry.tokens), nbytes=entry.nbytes, reason=reason)
            return True
        if entry.write_state == WriteState.FAILED and not self._retry_due(entry):
            if reason != "idle" and not entry.pinned:  # writes keep failing: RAM stays bounded
                self.counters["dropped_unwritable"] += 1
                self._emit("drop_unwritable", ns=entry.ns, tokens=len(entry.tokens), nbytes=entry.nbytes,
                           error=entry.write_error)
                return True
            return False
        if entry.write_state in UNWRITTEN:
            self._queue_write(entry)
        return False

    def may_supersede(self, ancestor: Entry, by: Entry) -> bool:
        """A longer checkpoint that serves this one replaces it: its write, if still
        queued, is dropped (the successor's file will cover it), so a growing chat
        neither writes every turn nor holds every turn's buffers in the queue."""
        if ancestor.write_state == WriteState.PENDING and self.writer.cancel((ancestor.ns, ancestor.tokens)):
            self.counters["writes_cancelled"] += 1
        return True

    def may_move(self, entry: Entry, n: int) -> bool:
        """An entry whose write is queued or being written: a borrower extending all of it
        writes a successor that covers it, and one rerunning its prompt replaces its old
        answer, so that write is dropped (or stopped at its next pause point, a few ms) and
        the buffers move: no copy of the prefix, whether the last write finished or not."""
        return self._stop_write(entry)

    def may_step_aside(self, entry: Entry) -> bool:
        """A loan in place (in_place.py): a queued write holds views of the entry's buffers (MLX would
        copy them), so it goes as for a move; the entry comes back dirty and is queued again."""
        return self._stop_write(entry)

    def _stop_write(self, entry: Entry) -> bool:
        if entry.write_state != WriteState.PENDING:
            return True
        key = (entry.ns, entry.tokens)
        if self.writer.cancel(key):
            self.counters["writes_cancelled"] += 1
            entry.write_state = WriteState.DIRTY
            return True
        if not self.writer.abort(key, ABORT_WAIT_S):
            return False  # still writing (a slow disk): lend views
        self.drain_completions()  # committed after all, or given up (dirty); its views are released here
        return True

    def tail_expendable(self, entry: Entry) -> bool:
        # With SSD on, only a durable entry's tail may leave RAM (a restore away), or one
        # whose write is still queued (dropped by may_move: the rerun replaces it).
        return (self.store is None or entry.write_state == WriteState.PENDING
                or self.store.has_durable_prefix(entry.tokens, entry.ns))

    def extra_bytes(self) -> int:
        """In-flight checkpoints waiting for the disk: they count against the RAM budget."""
        return self.writer.pending(urgent_only=True)[1] if self.writer is not None else 0

    def freed(self) -> None:
        """Give buffers freed by evictions back to the system instead of MLX's allocator cache:
        memory the cache let go should show in the process's RSS."""
        import mlx.core as mx

        mx.clear_cache()

    # --- publication and persistence ---

    def published(self, entry: Entry, defer_write: bool = False) -> None:
        """A new RAM entry: dirty, and with write-behind its write queued (defer_write: left dirty
        until `queue_dirty()`, so a prompt snapshot the final checkpoint supersedes a moment later
        is never written at all)."""
        if entry.write_state is None:  # (an oversized put queued its one write already)
            entry.write_state = WriteState.NONE if self.store is None else WriteState.DIRTY
            if self.store is not None and self.write_behind and not defer_write:
                self._queue_write(entry)

    def restored(self, entry: Entry) -> None:
        """An entry read back from SSD or the remote tier: committed if a local file holds it."""
        entry.restored = True
        durable = self.store is not None and self.store.contains(entry.tokens, entry.ns)
        entry.write_state = WriteState.COMMITTED if durable else WriteState.DIRTY if self.store else WriteState.NONE

    def queue_dirty(self) -> None:
        """Queue persistence of every dirty entry (write-behind)."""
        if self.write_behind and self.store is not None:
            for e in self.ram.entries():
                if e.write_state == WriteState.DIRTY:
                    self._queue_write(e)

    def _queue_write(self, entry: Entry) -> None:
        if (entry.write_state in (WriteState.PENDING, WriteState.COMMITTED) or entry.ns not in self.identities
                or self.held(entry.ns, entry.tokens)):  # not verified yet: kept from SSD until it is
            return
        if self.store is None:
            return
        if entry.tokens and not entry.checkpoint.attachments and self.store.contains(entry.tokens, entry.ns):
            # The same tokens are committed already (a rerun of a cell): that file serves them
            # as well as this state would (their KV may differ by a cold run's rounding).
            entry.write_state = WriteState.COMMITTED
            self.counters["writes_skipped_stored"] += 1
            return
        job = WriteJob.from_checkpoint(entry.checkpoint, entry.ns, self.identities[entry.ns],
                                       key=(entry.ns, entry.tokens))
        self.writer.submit(job)
        entry.write_state = WriteState.PENDING
        self.counters["writes_queued"] += 1
        self._emit("write_queued", ns=entry.ns, tokens=len(entry.tokens), nbytes=entry.nbytes)

    def _retry_due(self, entry: Entry) -> bool:
        at, count = self._failures.get((entry.ns, entry.tokens), (0.0, 0))
        return time.monotonic() - at > min(RETRY_FAILED_AFTER_S * 2 ** max(count - 1, 0), RETRY_MAX_S)

    def persist(self, entry: Entry, timeout: float | None = None) -> bool:
        """Make exactly this entry durable now (named checkpoints); True when committed."""
        if self.store is None:
            return False
        if not self.store.contains(entry.tokens, entry.ns):
            if entry.write_state in (WriteState.PENDING, WriteState.COMMITTED):
                entry.write_state = WriteState.DIRTY  # its file was superseded or capped away: write it again
            self._wait_writes(timeout)
            self.poll()
            if not self.store.contains(entry.tokens, entry.ns) and not self.store.catalog.late:
                entry.write_state = WriteState.DIRTY
                self._queue_write(entry)
                self._wait_writes(timeout)
                self.poll()
        return self.store.contains(entry.tokens, entry.ns)

    def _wait_writes(self, timeout: float | None) -> bool:
        """Wait for the writer (at most `timeout`); give up sooner when another process holds
        the catalogue's lock: the writes wait for it, a cell does not. True when drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.25 if deadline is None else min(0.25, deadline - time.monotonic())
            if self.writer.wait(max(left, 0.0)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if self.store.catalog.late or self.store.catalog.locked_elsewhere():
                return False

    def queue_inflight(self, cp: Checkpoint, ns: str, request: str, on_commit: Callable) -> None:
        """Queue an in-flight generation checkpoint: SSD only, never waiting for the generation.

        One request keeps at most one interval waiting: a newer one replaces it
        (the older is never written), so memory stays bounded at any interval.
        """
        job = WriteJob.from_checkpoint(cp, ns, self.identities[ns], key=("inflight", ns, cp.tokens), urgent=True,
                                       on_commit=on_commit, coalesce=("inflight", request))
        self.counters["inflight_replaced" if self.writer.submit(job) else "inflight_queued"] += 1

    def drain_completions(self) -> None:
        """Apply finished writes now (owner thread): their buffers are released here.
        A generation that checkpoints calls this before each capture, so finished
        intervals do not pile up until it ends."""
        if self.writer is not None:
            for done in self.writer.poll():
                self._completed(done)

    def inflight_busy(self, request: str) -> bool:
        """Whether a new capture should wait: this request's previous interval is still being
        written, or was written so recently that another now would take more than
        INFLIGHT_DUTY of the machine from decoding."""
        if self.writer is None:
            return False
        if self.writer.writing(("inflight", request)):
            return True
        self.drain_completions()  # learn when the last interval finished, and free it
        rest = self._inflight_last[1] * (1 / INFLIGHT_DUTY - 1)
        return time.monotonic() - self._inflight_last[0] < rest

    # --- the owner thread's turn ---

    def poll(self) -> None:
        """Apply writer completions and other processes' deletions, retry failures,
        demote idle entries, tell the catalogue how much this process has pending."""
        if self.writer is None:
            return
        self.drain_completions()
        self.store.sync()
        if self.store.rebuilds != self._rebuilds_seen:  # a rebuilt catalogue lost its pins: from the records
            self._rebuilds_seen = self.store.rebuilds
            self.pins.sync()
        while self._vanished:
            self._uncovered(*self._vanished.pop())
        self.queue_dirty()
        for e in self.ram.entries():
            if e.write_state == WriteState.FAILED and self._retry_due(e):
                self._queue_write(e)
        self._demote_idle()
        self.ram.enforce_budget()
        self.store.catalog.pending = self.writer.pending()  # the catalogue's keeper records it

    def _completed(self, done) -> None:
        if done.key[0] == "inflight":
            self._inflight_last = (time.monotonic(), done.seconds)
            self._emit("inflight_committed" if done.ok else "write_failed", ns=done.namespace,
                       tokens=done.tokens, error=None if done.ok else str(done.error))
            return
        ns, tokens = done.key
        entry = self.ram.get_exact(tokens, ns)
        if isinstance(done.error, WriteCancelled):  # given up for a borrower (may_move): not a failure
            self.counters["writes_cancelled"] += 1
            if entry is not None and entry.write_state == WriteState.PENDING:
                entry.write_state = WriteState.DIRTY
            return
        if done.ok:
            self.counters["writes_committed"] += 1
            self.counters["bytes_written"] += int(done.bytes or 0)
            self._failures.pop(done.key, None)
            self.write_error = self._error_kind = None
            if entry is not None:
                entry.write_state, entry.write_error = WriteState.COMMITTED, None
            self._emit("write_committed", ns=ns, tokens=len(tokens), nbytes=done.bytes, seconds=done.seconds)
            return
        self.counters["writes_failed"] += 1
        self._failures[done.key] = (time.monotonic(), self._failures.get(done.key, (0, 0))[1] + 1)
        kind = (type(done.error).__name__, getattr(done.error, "errno", None))  # the same failure, another file
        first, self._error_kind = kind != self._error_kind, kind
        self.write_error = str(done.error)
        if entry is not None:
            entry.write_state, entry.write_error = WriteState.FAILED, str(done.error)
        if first:  # one event per distinct error, not one per retry
            self._emit("write_failed", ns=ns, tokens=len(tokens), error=str(done.error))

    def _uncovered(self, ns: str, tokens: tuple) -> None:
        """A file is gone: entries it made durable are dirty again, unless another file covers them."""
        for e in self.ram.entries(ns):
            if (e.write_state == WriteState.COMMITTED and len(e.tokens) <= len(tokens)
                    and tokens[: len(e.tokens)] == e.tokens and not self.store.has_durable_prefix(e.tokens, ns)):
                e.write_state = WriteState.DIRTY

    def _demote_idle(self) -> None:
        if self.idle_demote_s is None or self.store is None:
            return
        cutoff = time.time() - self.idle_demote_s
        for e in self.ram.entries():
            if e.last_used_time < cutoff and not e.borrowers and not e.pinned and self.may_drop(e, "idle"):
                self.ram.forget(e)

    def flush(self, timeout: float | None = None) -> dict:
        """Persist every dirty or failed entry and wait; report what is durable."""
        if self.writer is None:
            return {"committed": 0, "failed": [], "pending": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        committed_before = self.counters["writes_committed"]
        self.poll()
        for e in self.ram.entries():
            if e.write_state in UNWRITTEN:
                self._queue_write(e)
        failed_before = self.counters["writes_failed"]
        self._wait_writes(timeout)
        self.poll()
        failed = [{"tokens": len(e.tokens), "error": e.write_error}
                  for e in self.ram.entries() if e.write_state == WriteState.FAILED]
        report = {
            "committed": self.counters["writes_committed"] - committed_before,
            "failed": failed,
            "failed_writes": self.counters["writes_failed"] - failed_before,
            "pending": self.writer.pending()[0],
            "seconds": time.perf_counter() - t0,
            "late_reason": self.store.catalog.late,  # why writes are still pending, if the catalogue is locked
        }
        self._emit("flush", **{k: v for k, v in report.items() if k != "failed"}, failed_count=len(failed))
        return report

    def wait_for_writes(self, timeout: float | None = None) -> dict:
        """Wait for writes already queued, from any thread (touches no MLX, queues nothing)."""
        if self.writer is None:
            return {"committed": 0, "pending": 0}
        before = self.writer.pending()[0]
        self.writer.wait(None if timeout is None else max(timeout, 0.0))
        pending = self.writer.pending()[0]
        return {"committed": max(before - pending, 0), "pending": pending}

    def stats(self) -> dict:
        pending_count, pending_bytes = self.writer.pending() if self.writer else (0, 0)
        in_progress = self.writer.in_progress if self.writer else None
        entries = self.ram.entries()
        dirty = [e for e in entries if e.write_state == WriteState.DIRTY]
        failed = [e for e in entries if e.write_state == WriteState.FAILED]
        return {
            "write_behind": self.write_behind,
            "pending_writes": pending_count,
            "pending_write_bytes": pending_bytes,
            "write_in_progress_bytes": in_progress[0] if in_progress else 0,
            "write_in_progress_total": in_progress[1] if in_progress else 0,
            "dirty_entries": len(dirty),
            "dirty_bytes": sum(e.nbytes for e in dirty),
            "failed_entries": len(failed),
            "failed_bytes": sum(e.nbytes for e in failed),
            "write_error": self.write_error,
        }

    # --- pins (named checkpoints) ---

    def pin(self, entry: Entry, name: str) -> bool:
        """Pin `entry` under `name` and make it durable now; False (and no pin) if the write fails."""
        entry.pinned.add(name)
        if self.store is None:
            return True
        self.pins.set(name, entry.ns, entry.tokens)
        if self.persist(entry) or (self.store.catalog.late and entry.write_state == WriteState.PENDING):
            return True  # (late: pinned in RAM, its write queued for when the catalogue is free)
        entry.pinned.discard(name)
        self.pins.set(name, None, None)
        return False

    def unpin(self, ns: str, tokens: Sequence[int], name: str) -> None:
        entry = self.ram.get_exact(tokens, ns)
        if entry is not None:
            entry.pinned.discard(name)
        if self.store is not None:
            self.pins.set(name, None, None)
