"""Background restores: the reader thread, its jobs, and what to prefetch.

A read is split by thread (ssd/restore.py `Restore`): the owner (MLX) thread
opens the file and allocates MLX buffers, the reader thread reads and
verifies into their numpy views, and the owner builds the checkpoint when it
collects the finished job (`poll`), then adopts it into RAM (tiered.py).

- Buffers are allocated on the owner a window ahead of the reader
  (`ahead_bytes`, at least one job), so only the window holds files open
  and leased (and allocated memory no read has filled yet).
- The reader yields to a running generation (`GenerationGate`, shared with
  the writer) before each job: BLAS wants the cores. A generation that needs a
  job never waits behind the yield: a job not being read yet is taken over
  by the owner (`claim`), which reads it at once; a job being read is waited
  for (`wait`).
- Jobs and their buffers are only ever released on the owner thread: the
  reader hands a finished job to the done list under the lock, so its
  reference is never the last one.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .gate import GenerationGate
from .ssd.index import IndexEntry

AHEAD_BYTES = 128 << 20  # buffers allocated ahead of the reader (beyond the job it reads)


@dataclass(eq=False)
class ReadJob:
    handle: IndexEntry  # the file to read
    kind: str = "prefetch"  # "prefetch": speculative, only into free room; "restore": asked for; "lookup": needed now
    exact: int | None = None  # adopt the first `exact` tokens only (a named checkpoint inside a longer file)
    then: list = field(default_factory=list)  # callables(entry) run on the owner once adopted
    restore: object = None  # ssd.restore.Restore once opened and allocated (owner)
    state: str = "queued"  # queued -> ready (allocated) -> reading -> done
    ok: bool = False
    error: str | None = None
    background: bool = False  # submitted to the reader (counted as a prefetch)
    submitted: float = field(default_factory=time.monotonic)
    cost: int | None = None  # bytes it adds to RAM, blocks resident or read already counted once (None: all)
    blocks: tuple = ()  # (name, start, end) of the blocks it read (set when built)

    @property
    def key(self) -> tuple:
        return (self.handle.namespace, self.handle.key)

    @property
    def nbytes(self) -> int:
        """Bytes it adds to RAM once adopted (its buffers while it is read: `handle.raw_bytes`)."""
        return self.handle.raw_bytes if self.cost is None else self.cost


class BackgroundReader:
    """The reader thread and its queue. Every method but the thread's own is for the owner."""

    def __init__(self, open_job: Callable[[ReadJob], None], *, ahead_bytes: int = AHEAD_BYTES,
                 gate: GenerationGate | None = None):
        self.open_job = open_job  # owner: sets job.restore (open + allocate), or marks the job failed
        self.ahead_bytes = ahead_bytes
        self.gate = gate or GenerationGate()  # shared with the writer (tiered.py)
        self._cv = threading.Condition()
        self._queue: list[ReadJob] = []  # queued and ready jobs, in order
        self._done: list[ReadJob] = []  # finished, until poll()
        self._busy: ReadJob | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-reader", daemon=True)
        self._thread.start()

    # --- owner ---

    def submit(self, job: ReadJob, *, first: bool = False) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("reader is closed")
            self._queue.insert(0 if first else len(self._queue), job)
        self.prepare(job if first else None)

    def prepare(self, job: ReadJob | None = None) -> None:
        """Open and allocate queued jobs a window ahead of the reader (and `job` at once)."""
        with self._cv:
            queued = list(self._queue)
        ahead = 0
        for j in queued:  # (the window counts what reads allocate: whole files)
            if j.state == "ready":
                ahead += j.handle.raw_bytes
            elif j.state == "queued" and (j is job or ahead == 0 or ahead + j.handle.raw_bytes <= self.ahead_bytes):
                self.open_job(j)  # owner thread: MLX allocation
                with self._cv:
                    if j.restore is None:  # could not be opened: finished (failed)
                        self._finish(j)
                        continue
                    j.state = "ready"
                    self._cv.notify_all()
                ahead += j.handle.raw_bytes

    def job(self, key: tuple) -> ReadJob | None:
        """The unfinished or uncollected job reading this file, if any."""
        with self._cv:
            for j in [self._busy, *self._queue, *self._done]:
                if j is not None and j.key == key:
                    return j
        return None

    def jobs(self) -> list[ReadJob]:
        with self._cv:
            return [j for j in [self._busy, *self._queue] if j is not None]

    def claim(self, job: ReadJob) -> bool:
        """Take a job the reader has not started out of its queue (the owner reads it now)."""
        with self._cv:
            if job in self._queue:
                self._queue.remove(job)
                return True
        return False

    def wait(self, job: ReadJob, timeout: float) -> bool:
        """Wait until a job being read is finished; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: job.state == "done", timeout)

    def collect(self, job: ReadJob) -> None:
        """Remove a finished job from the done list (the owner handles it itself)."""
        with self._cv:
            if job in self._done:
                self._done.remove(job)

    def poll(self) -> list[ReadJob]:
        """Finished jobs, oldest first."""
        with self._cv:
            done, self._done = self._done, []
        return done

    def pending(self) -> tuple[int, int]:
        """(jobs, bytes) queued or being read."""
        jobs = self.jobs()
        return len(jobs), sum(j.nbytes for j in jobs)

    def drop(self, keep: Callable[[ReadJob], bool]) -> list[ReadJob]:
        """Remove queued jobs (not one being read) that `keep` rejects; returns them."""
        with self._cv:
            dropped = [j for j in self._queue if not keep(j)]
            self._queue = [j for j in self._queue if keep(j)]
        return dropped

    def close(self, timeout: float = 30.0) -> list[ReadJob]:
        """Stop the thread after the read in progress; returns every job not collected
        (the owner closes them: they hold files and buffers)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
        with self._cv:
            left, self._queue, self._done = self._queue + self._done, [], []
            if self._busy is not None:  # still reading after the timeout: leave it to the thread
                left = [j for j in left if j is not self._busy]
        return left

    # --- reader thread ---

    def _finish(self, job: ReadJob) -> None:
        """(lock held) A job is done: to the done list, its reference handed over."""
        if job in self._queue:
            self._queue.remove(job)
        job.state = "done"
        self._done.append(job)
        self._cv.notify_all()

    def _next(self) -> ReadJob | None:
        with self._cv:
            while not self._closed and not any(j.state == "ready" for j in self._queue):
                self._cv.wait()
        while self.gate.running and not self._closed:  # yield the cores to the generation
            self.gate.wait_idle(0.1)
        with self._cv:
            if self._closed:
                return None
            job = next((j for j in self._queue if j.state == "ready"), None)
            if job is not None:
                self._queue.remove(job)
                job.state, self._busy = "reading", job
            return job

    def _run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                with self._cv:
                    if self._closed:
                        return
                continue
            try:
                job.ok = job.restore.fill()
            except Exception as exc:  # a bug, not a cache problem: the owner reports it as a failed read
                job.ok, job.error = False, f"{type(exc).__name__}: {exc}"
            with self._cv:
                self._busy = None
                self._finish(job)
                job = None


def covers(handle: IndexEntry, tokens: tuple, n: int | None = None) -> bool:
    """Whether `handle`'s file can serve the first `n` (default: all) of `tokens`."""
    n = len(tokens) if n is None else n
    return len(handle) >= n and handle.can_serve(n) and handle.tokens[:n] == tuple(tokens[:n])


def common_blocks(a: tuple, b: tuple) -> int:
    """Tokens two checkpoints' block lists ((name, start, end), in order) hold alike: the end of
    the last of their equal leading blocks (a block's name is the hash of its bytes)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n = x[2]
    return n


class SharedBytes:
    """What prefetching a file adds to RAM, the blocks it shares with files resident, being read
    or chosen before it counted once: its KV bytes less those blocks' bytes (the catalogue's
    `refs`: which blocks each file uses)."""

    def __init__(self, blocks_of: dict, counted: Iterable[str] = ()):
        self.blocks_of = blocks_of  # file key -> {block name: bytes}
        self.counted = set(counted)

    def cost(self, h: IndexEntry) -> int:
        mine = self.blocks_of.get(h.key, {})
        return max(0, h.raw_bytes - sum(b for name, b in mine.items() if name in self.counted))

    def count(self, h: IndexEntry) -> None:
        self.counted.update(self.blocks_of.get(h.key, ()))


def choose(candidates: Iterable[IndexEntry], budget: int, resident: Callable[[tuple, str], bool],
           reading: Iterable[IndexEntry] = (), shared: SharedBytes | None = None,
           too_large: list | None = None) -> list[IndexEntry]:
    """What to prefetch: newest `last_use` first, while what they add to RAM fits `budget`
    (`shared.cost`: blocks several files share counted once); skipping files already resident
    (`resident(tokens, ns)`), being read, or served by a longer file already chosen or being
    read (a superseded prefix). Files larger than the whole budget go to `too_large` (the caller says so)."""
    shared = shared or SharedBytes({})
    chosen, taken, whole = [], list(reading), budget
    for h in taken:
        shared.count(h)
    for h in sorted(candidates, key=lambda h: -h.last_use):
        if resident(tuple(h.tokens), h.namespace):
            continue
        cost = shared.cost(h)
        if cost > whole and too_large is not None:
            too_large.append((h, cost))
        if cost > budget:
            continue
        if any(o.namespace == h.namespace and covers(o, h.tokens) for o in taken):
            continue
        chosen.append(h)
        taken.append(h)
        shared.count(h)
        budget -= cost
    # a longer file chosen later (older) may still serve an earlier, shorter one: keep the longer
    return [h for h in chosen if not any(o is not h and o.namespace == h.namespace and len(o) > len(h)
                                         and covers(o, h.tokens) for o in chosen)]

