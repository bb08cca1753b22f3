"""The loading part of the tiered cache: SSD checkpoints back into RAM, at once for a
lookup that needs one, in the background for prefetches, named checkpoints and sessions.

Every read is a `ReadJob` (prefetch.py). The reader thread does the I/O;
opening, allocating, building and adopting run on the owner thread, here.

- `prefetch(ns)` (after a model loads): the namespace's most recently used
  files, newest first, up to the prefetch budget and never past the room
  RAM has: a prefetch never evicts anything, and one that no longer fits
  when it finishes (or is resident by then) is dropped.
- `load(tokens, ns)` (`%checkpoint restore`, `%session switch`): one file in
  the background, ahead of the prefetches; it is adopted whatever the room.
- `read_now(handle)` (a lookup): a job the reader has not started is taken
  over and read at once; one being read is waited for (bounded); otherwise
  the file is read here. Never two reads of one file.

The prefetch budget: `prefetch_budget_bytes`, or by default a quarter of
the RAM budget; with the adaptive budget (None) a quarter of the memory the
kernel may use (`PressureGuard`: its working set plus what the machine has
available), and never past the low-water mark, so prefetching never sets
off a reclaim. 0 turns prefetching off. A file larger than the whole prefetch
budget is not prefetched, and `prefetch()` says so once ("note", and a
"prefetch_skipped" event); a lookup that needs it reads it whatever its size.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ..kv.checkpoint import Checkpoint
from ..kv.tokens import as_token_array, common_prefix_len
from ..host.memory import PressureGuard
from ..metrics import fmt_bytes
from .gate import GenerationGate
from .prefetch import BackgroundReader, ReadJob, SharedBytes, choose, common_blocks
from .entry import Entry
from .ram import RamTier
from .ssd.index import IndexEntry
from .ssd.restore import Restore
from .ssd.store import CheckpointStore, CheckpointUnavailable

# Reading and verifying a file costs more than prefilling a handful of tokens.
MIN_RESTORE_TOKENS = 16
WAIT_READ_S = 30.0  # a lookup waits this long at most for a read in progress (then: a miss)


class Loading:
    def __init__(self, ram: RamTier, store: CheckpointStore | None, *, gate: GenerationGate, counters: dict,
                 emit: Callable[..., object], adopt: Callable[[Checkpoint, str], Entry],
                 pressure: Callable[[], PressureGuard | None], prefetch_budget_bytes: int | None):
        """adopt(checkpoint, namespace): publish a finished read in RAM (the tiered cache's);
        pressure(): the engine's memory guard, once it has one."""
        self.ram, self.store, self.counters, self._emit = ram, store, counters, emit
        self.adopt, self._pressure = adopt, pressure
        self.prefetch_budget_bytes = prefetch_budget_bytes
        self.counters.update(dict.fromkeys((
            "prefetches_started", "prefetches_completed", "prefetches_failed", "prefetches_dropped",
            "prefetch_bytes", "prefetch_waits", "prefetch_wait_seconds", "restore_shared_bytes",
        ), 0))
        self.counters["prefetch_wait_seconds"] = 0.0
        self.reader = BackgroundReader(self._open_job, gate=gate) if store is not None else None

    # --- what to read ---

    def prefetch_budget(self) -> int:
        """Bytes a prefetch may bring into RAM now (the setting, bounded by the room RAM has)."""
        if self.reader is None or self.prefetch_budget_bytes == 0:
            return 0
        room = self._room()
        if self.prefetch_budget_bytes is not None:
            return max(0, min(self.prefetch_budget_bytes, room))
        if self.ram.budget_bytes is not None:
            return max(0, min(self.ram.budget_bytes // 4, room))
        r = self._memory()
        return max(0, min(r.may_use // 4, room)) if r is not None else 0

    def _memory(self):
        guard = self._pressure()
        if guard is None:
            return None
        return guard.read()

    def _room(self, reading: bool = True) -> int:
        """Bytes RAM can take without evicting anything (or passing the low-water mark)."""
        busy = self.reader.pending()[1] if reading and self.reader is not None else 0
        if self.ram.budget_bytes is not None:
            return self.ram.budget_bytes - self.ram.used_bytes - busy
        guard = self._pressure()
        r = guard.last if guard is not None else None
        if r is None:
            return 1 << 62
        return 0 if guard.active else int(guard.low * r.may_use) - r.working - busy

    def _resident(self, tokens: tuple, ns: str) -> bool:
        """Whether a RAM entry serves exactly `tokens` (itself, or a longer one that can be cut)."""
        if self.ram.get_exact(tokens, ns) is not None:
            return True
        arr, n = as_token_array(tokens), len(tokens)
        return any(len(e.tokens) > n and e.checkpoint.can_serve(n) and common_prefix_len(e.token_array, arr) >= n
                   for e in self.ram.entries(ns))

    def prefetch(self, ns: str) -> dict:
        """Queue the namespace's most recently used SSD checkpoints for reading into RAM."""
        budget = self.prefetch_budget()
        if budget <= 0:
            return {"checkpoints": 0, "bytes": 0, "budget_bytes": budget}
        reading = [j.handle for j in self.reader.jobs()]
        sizes, resident = self.store.block_sizes(ns), [b[0] for e in self.ram.entries(ns) for b in e.blocks]
        too_large: list = []
        chosen = choose([h for h in self.store.entries() if h.namespace == ns], budget, self._resident, reading,
                        SharedBytes(sizes, resident), too_large)
        shared, total = SharedBytes(sizes, resident), 0
        for h in reading:
            shared.count(h)
        for h in chosen:
            cost = shared.cost(h)
            shared.count(h)
            self._submit(ReadJob(h, cost=cost))
            total += cost
        if chosen:
            self._emit("prefetch", ns=ns, checkpoints=len(chosen), nbytes=total, budget=budget)
        note = None
        if too_large:  # said once, here: the first use of each restores it (a lookup reads whatever its size)
            n, largest = len(too_large), max(c for _, c in too_large)
            note = (f"{n} cached prompt{'s' if n > 1 else ''} larger than the prefetch budget ({fmt_bytes(budget)}; "
                    f"the largest {fmt_bytes(largest)}): not prefetched, the first use restores "
                    + ("them" if n > 1 else "it"))
            self._emit("prefetch_skipped", ns=ns, checkpoints=n, largest=largest, budget=budget, note=note)
        return {"checkpoints": len(chosen), "bytes": total, "budget_bytes": budget, "too_large": len(too_large),
                "note": note}

    def load(self, tokens: Sequence[int], ns: str, *, exact: bool = True,
             then: Callable[[Entry], None] | None = None) -> tuple[str | None, int]:
        """Bring a state into RAM in the background; ("ram" | "loading" | None, tokens).

        exact: the state of exactly `tokens` (a named checkpoint); otherwise the
        longest cached prefix that could continue `tokens` (a session's state).
        `then(entry)` runs on the owner once it is resident (at once if it is).
        """
        tokens = tuple(tokens)
        if exact:
            entry, n = self.ram.get_exact(tokens, ns), len(tokens)
        else:
            entry, n = self.ram.best(tokens, ns)
        if entry is not None and then is not None:
            then(entry)
        if self.store is None:
            return ("ram" if entry is not None else None), n
        if exact:
            handle = None if entry else self.store.find(tokens + (-1,), ns, min_len=len(tokens))  # at most `tokens`
            if handle is None or handle.match_len != len(tokens):
                return ("ram" if entry is not None else None), n
        else:
            handle = self.store.find(tokens, ns, min_len=max(MIN_RESTORE_TOKENS, n + 1))
            if handle is None:
                return ("ram" if entry is not None else None), n
        want = len(tokens) if exact and len(handle) > len(tokens) else None
        job = self.reader.job((handle.namespace, handle.key))
        if job is None or job.exact != want:
            job = self._submit(ReadJob(handle, kind="restore", exact=want), first=True)
        job.kind = "restore"  # asked for now: adopted whatever the room
        if then is not None:
            job.then.append(then)
        return "loading", want or handle.match_len

    def _submit(self, job: ReadJob, first: bool = False) -> ReadJob:
        self.counters["prefetches_started"] += 1
        job.background = True
        self.reader.submit(job, first=first)
        return job

    # --- the reads ---

    def _open_job(self, job: ReadJob) -> None:
        """Open and allocate (owner); a prefetch only while RAM has room for it."""
        if job.kind == "prefetch" and job.nbytes > self._room(reading=False):
            job.error = "skipped: no room in RAM"
            return
        try:
            job.restore = Restore(self.store, job.handle, touch=job.kind != "prefetch")
        except CheckpointUnavailable as e:
            job.error = str(e)

    def read_now(self, handle: IndexEntry, progress: Callable[[int, int], None] | None = None
                 ) -> tuple[Checkpoint | None, ReadJob]:
        """Read `handle`'s file for a lookup that needs it now, sharing a background read of it
        (progress(tokens read, tokens) as blocks land, when it is read here)."""
        job = self.reader.job((handle.namespace, handle.key)) if self.reader is not None else None
        if job is not None and job.state == "done" and job.restore is None:  # finished without reading (skipped)
            self.reader.collect(job)
            self._build(job)  # counted as dropped or failed
            job = None
        if job is not None and job.state != "done" and not self.reader.claim(job):
            t0 = time.perf_counter()
            done = self.reader.wait(job, WAIT_READ_S)
            self.counters["prefetch_waits"] += 1
            self.counters["prefetch_wait_seconds"] += time.perf_counter() - t0
            if not done:  # the disk hangs: prefill instead; the read is adopted when it ends
                self._emit("restore_failed", ns=handle.namespace, tokens=len(handle), reason="read timed out")
                return None, job
        if job is None:
            job = ReadJob(handle)
        job.kind = "lookup" if job.kind == "prefetch" else job.kind  # needed: adopted whatever the room
        if job.restore is not None:
            job.restore.read.touch = True  # a use of the file after all
        if job.state != "done":  # not started: read it here
            if job.restore is None and job.error is None:
                self._open_job(job)
            job.ok = job.restore is not None and job.restore.fill(progress)
            job.state = "done"
        if self.reader is not None:
            self.reader.collect(job)
        return self._build(job), job

    def _build(self, job: ReadJob) -> Checkpoint | None:
        """The finished job's checkpoint (owner), or None (counted, reported) when it failed."""
        background = job.background
        try:
            if job.restore is None:
                if job.error and job.error.startswith("skipped"):
                    self.counters["prefetches_dropped"] += 1
                    self._emit("prefetch_dropped", ns=job.handle.namespace, tokens=len(job.handle), reason=job.error)
                    return None
                raise CheckpointUnavailable(job.error or "not opened")
            header = job.restore.read.header
            cp = job.restore.finish()
        except CheckpointUnavailable as e:
            self.counters["ssd_restore_failures"] += 1
            self.counters["prefetches_failed"] += background
            self._emit("restore_failed", ns=job.handle.namespace, tokens=len(job.handle), reason=str(e),
                       background=background)
            return None
        finally:
            job.restore = None  # the buffers go here, on the owner
        if background:
            self.counters["prefetches_completed"] += 1
            self.counters["prefetch_bytes"] += cp.nbytes
        if job.exact is not None and job.exact < len(cp.tokens):
            cp = cp.prefix(job.exact)
        job.blocks = tuple((b.name, b.start, b.end) for b in header.blocks if b.end <= len(cp.tokens))
        return self._share(cp, job)

    def _share(self, cp: Checkpoint, job: ReadJob) -> Checkpoint:
        """The restored checkpoint holding what it read alike with a resident entry (the same blocks)
        in that entry's buffers, as published checkpoints share a lent prefix: a document under
        several questions is held once after a restart too (its own positions are copied out)."""
        donor, n = None, 0
        for e in self.ram.entries(job.handle.namespace):
            alike = common_blocks(e.blocks, job.blocks)
            if alike > n:
                donor, n = e, alike
        shared = cp.sharing(donor.checkpoint, n) if donor is not None else None
        if shared is None:
            return cp
        theirs = {id(b) for b in donor.checkpoint.buffers()}
        self.counters["restore_shared_bytes"] += sum(n for b, n in shared.segment_uses() if id(b) in theirs)
        return shared

    def adopt_job(self, job: ReadJob, cp: Checkpoint) -> Entry:
        """Publish a finished read in RAM and run what waited for it (owner)."""
        entry = self.adopt(cp, job.handle.namespace)
        entry.blocks = tuple(b for b in job.blocks if b[2] <= len(cp.tokens))
        for fn in job.then:
            fn(entry)
        job.then = []
        self._emit("prefetched", ns=entry.ns, tokens=len(entry.tokens), nbytes=cp.nbytes, kind=job.kind)
        return entry

    def collect(self, prepare: bool) -> None:
        """Adopt finished background reads (owner); with prepare, allocate the next ones."""
        if self.reader is None:
            return
        guard = self._pressure()
        if guard is not None and guard.active:  # memory is short: no speculative reads
            for job in self.reader.drop(lambda j: j.kind != "prefetch"):
                job.error = "skipped: memory pressure"
                self._close_job(job)
        adopted = False
        for job in self.reader.poll():
            cp = self._build(job)
            if cp is None:
                continue
            if job.kind == "prefetch" and (self._resident(cp.tokens, job.handle.namespace)
                                           or self.ram.added_bytes(cp) > self._room(reading=False)):
                self.counters["prefetches_dropped"] += 1
                self._emit("prefetch_dropped", ns=job.handle.namespace, tokens=len(cp.tokens), reason="resident or no room")
                continue
            self.adopt_job(job, cp)
            adopted = True
        if adopted:
            self.ram.enforce_budget()
        if prepare:
            self.reader.prepare()

    def prepare_reads(self) -> None:
        """Allocate the next background reads' buffers (owner; after a generation, between cells)."""
        if self.reader is not None:
            self.reader.prepare()

    def _close_job(self, job: ReadJob) -> None:
        if job.restore is not None:
            job.restore.close()
            job.restore = None
        self.counters["prefetches_dropped"] += 1

    def wait_reads(self, timeout: float | None = None) -> bool:
        """Finish every background read now and adopt it (owner); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.reader is not None:
            self.reader.prepare()
            jobs = self.reader.jobs()
            if not jobs:
                break
            left = WAIT_READ_S if deadline is None else deadline - time.monotonic()
            if left <= 0 or not self.reader.wait(jobs[0], left):
                return False
            self.collect(prepare=False)
        self.collect(prepare=False)  # what finished last
        return True

    def cancel_reads(self) -> None:
        """Drop every queued read and wait for the one in progress (owner): clear, close."""
        if self.reader is None:
            return
        for job in self.reader.drop(lambda j: False):
            self._close_job(job)
        for job in self.reader.jobs():  # the one being read
            self.reader.wait(job, WAIT_READ_S)
        for job in self.reader.poll():
            self._close_job(job)

    def close_reader(self) -> None:
        if self.reader is not None:
            for job in self.reader.close():
                self._close_job(job)

    def stats(self) -> dict:
        jobs = self.reader.jobs() if self.reader is not None else []
        return {
            "prefetches_in_progress": len(jobs),
            "prefetch_in_progress_bytes": sum(j.nbytes for j in jobs),
            "prefetch_budget_bytes": self.prefetch_budget_bytes,
        }
