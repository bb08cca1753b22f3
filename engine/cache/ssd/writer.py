"""The background writer: one daemon thread that persists checkpoints.

The owner (MLX) thread prepares a WriteJob (numpy views of evaluated
arrays, see Checkpoint.host_tensors) and submits it. The thread writes its
new blocks and manifest (persist.py) and publishes it into the store index.
Finished jobs go to a completion list; the owner collects them with poll(),
which is also where the job's numpy views are dropped, so MLX memory is
only ever released on the owner thread.

Restores never queue behind writes: they have their own reader thread
(../prefetch.py), and a lookup reads on the owner thread (`restore.py`).
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..catalog.database import background_thread
from ..gate import GenerationGate
from . import format as fmt
from .persist import persist
from .store import CheckpointStore


class WriteCancelled(Exception):
    """A write given up at a pause point (`CheckpointWriter.abort`): nothing of it was committed."""


@dataclass
class WriteJob:
    namespace: str
    identity: dict
    tokens: tuple
    layout: list
    min_reusable_offset: int
    host_tensors: list
    trimmable: bool
    codec: str = fmt.DEFAULT_CODEC
    key: Any = None  # caller's handle, returned in the completion
    urgent: bool = False  # never waits for a generation (in-flight checkpoints)
    on_commit: Callable[[Any], None] | None = None  # writer thread, after publish: plain file work only
    coalesce: Any = None  # a newer job with the same value replaces this one while it waits

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.host_tensors)

    @classmethod
    def from_checkpoint(
        cls, cp, namespace: str, identity: dict, *, key: Any = None, codec: str = fmt.DEFAULT_CODEC,
        urgent: bool = False, on_commit: Callable[[Any], None] | None = None, coalesce: Any = None,
    ) -> "WriteJob":
        """Prepare on the owner thread (host_tensors evaluates views)."""
        return cls(
            namespace, dict(identity), tuple(cp.tokens), cp.layout(), int(cp.min_reusable_offset),
            cp.host_tensors(), bool(cp.trimmable), codec, key, urgent, on_commit, coalesce,
        )


@dataclass(frozen=True)
class Completion:
    key: Any
    ok: bool
    error: BaseException | None
    path: Path | None
    bytes: int  # bytes written on success (0: all of it was stored already), 0 on failure
    seconds: float
    namespace: str
    tokens: int  # token count of the checkpoint
    entry: Any = None  # the store's IndexEntry on success


class CheckpointWriter:
    """The writer thread and its yield rule.

    While a generation runs (`generating()`), BLAS wants both cores: a write
    then waits between chunks, unless it is urgent, an urgent job waits
    behind it, or the tier above reports memory pressure (`under_pressure`,
    RAM over budget and waiting on writes). A waiting writer sleeps on an
    event until the generation ends, re-checking pressure twice a second:
    each wake-up would take the GIL from decode.
    """

    def __init__(self, store: CheckpointStore, *, under_pressure: Callable[[], bool] | None = None,
                 gate: GenerationGate | None = None):
        self.store = store
        self.under_pressure = under_pressure or (lambda: False)
        self.yield_to_generation = True  # off only to measure what yielding buys
        self.gate = gate or GenerationGate()  # shared with the reader (tiered.py)
        self.on_committed: Callable[[Any], None] | None = None  # writer thread, after each publish (remote tier)
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()  # jobs
        self._done: list = []  # (job, completion), emptied by poll()
        self._busy: WriteJob | None = None  # job being written
        self._abort: Any = None  # key of the job being written that should stop at its next pause
        self._progress = (0, 0)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ckpt-writer", daemon=True)
        self._thread.start()

    def generating(self):
        """Mark a generation running (owner thread): non-urgent writes wait."""
        return self.gate.generating()

    # --- owner-thread API ---

    def submit(self, job: WriteJob) -> bool:
        """Queue a job; True when it replaced a waiting job with the same `coalesce` value
        (whose views are then released here, on the owner thread)."""
        with self._cv:
            if self._closed:
                raise RuntimeError("writer is closed")
            same = [i for i, j in enumerate(self._queue) if job.coalesce is not None and j.coalesce == job.coalesce]
            if same:
                self._queue[same[0]] = job
                return True
            if job.urgent:  # ahead of every non-urgent job, behind earlier urgent ones
                i = next((i for i, j in enumerate(self._queue) if not j.urgent), len(self._queue))
                self._queue.insert(i, job)
            else:
                self._queue.append(job)
            self._cv.notify_all()
            return False

    def poll(self) -> list[Completion]:
        """Finished completions, oldest first. Call on the owner thread: the
        jobs' numpy views (and so MLX buffers) are released here."""
        with self._cv:
            done, self._done = self._done, []
        out = [c for _, c in done]
        del done  # last references to the jobs' views go on this thread
        return out

    def pending(self, urgent_only: bool = False) -> tuple[int, int]:
        """(jobs, bytes) queued or being written (urgent_only: in-flight checkpoints only)."""
        with self._cv:
            items = [j for j in list(self._queue) + ([self._busy] if self._busy else []) if j.urgent or not urgent_only]
            return len(items), sum(j.nbytes for j in items)

    def cancel(self, key: Any) -> bool:
        """Drop a queued job (not one being written) by its key; True if one was dropped.
        Call on the owner thread: the job's views are released here."""
        with self._cv:
            for i, j in enumerate(self._queue):
                if j.key == key:
                    del self._queue[i]
                    self._cv.notify_all()
                    return True
        return False

    def abort(self, key: Any, timeout: float) -> bool:
        """Stop the job being written under this key at its next pause point (blocks already
        written stay, unreferenced, for gc) and wait for it, at most `timeout` s. True when it
        is no longer being written: given up (a WriteCancelled completion) or, if it got past
        its last pause first, committed. Owner thread: its borrower takes the buffers next."""
        with self._cv:
            if self._busy is None or self._busy.key != key:
                return True
            self._abort = key
        if self.wait_written(key, timeout):
            return True
        with self._cv:  # not at a pause point in time (a long fsync): let it finish after all
            if self._abort == key:
                self._abort = None
        return False

    def wait_written(self, key: Any, timeout: float) -> bool:
        """Wait (at most `timeout` s) while the job with this key is being written; True when it is not."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._busy is not None and self._busy.key == key:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def writing(self, coalesce: Any) -> bool:
        """Whether a job with this `coalesce` value is being written right now."""
        with self._cv:
            return self._busy is not None and self._busy.coalesce == coalesce

    @property
    def in_progress(self) -> tuple[int, int] | None:
        """(bytes done, bytes total) of the job being written, or None."""
        with self._cv:
            return self._progress if self._busy is not None else None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or being written; True if drained.
        Completions are left for poll()."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def close(self, *, wait: bool = True, timeout: float | None = None) -> None:
        """Stop the thread. wait=True finishes queued jobs first; otherwise
        queued jobs are dropped (here, on the owner thread) unwritten."""
        with self._cv:
            self._closed = True
            dropped = [] if wait else list(self._queue)
            if not wait:
                self._queue.clear()
            self._cv.notify_all()
        del dropped
        self._thread.join(timeout)

    # --- writer thread ---

    def _must_wait(self, job: WriteJob) -> bool:
        if job.urgent or not self.yield_to_generation or not self.gate.running:
            return False
        with self._cv:  # an urgent job waiting behind this one: finish at full speed
            if self._queue and self._queue[0].urgent:
                return False
        return not self.under_pressure()

    def _pause(self, job: WriteJob) -> None:
        while True:
            if self._abort is not None and self._abort == job.key:
                raise WriteCancelled(f"write of {len(job.tokens)} tokens given up: its buffers went to a borrower")
            if not self._must_wait(job):
                return
            self.gate.wait_idle(0.5)

    def _on_progress(self, done: int, total: int) -> None:
        with self._cv:
            self._progress = (done, total)

    def _run(self) -> None:
        background_thread()  # the catalogue's write lock may be held elsewhere: a write waits for it
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._busy, self._progress = job, (0, job.nbytes)
            completion = self._write(job)
            with self._cv:
                # hand the job over while poll() is locked out, so our
                # reference is never the last one to its views
                self._done.append((job, completion))
                job = None
                self._busy = self._abort = None
                self._cv.notify_all()

    def _write(self, job: WriteJob) -> Completion:
        t0 = time.perf_counter()
        n = len(job.tokens)
        try:
            done = persist(self.store, job, pause=lambda: self._pause(job), progress=self._on_progress)
            self.store.count_write(done.bytes_written, done.bytes_deduplicated)
            info = done.info
            entry = self.store.publish(info)
            if job.on_commit is not None:
                job.on_commit(info)
            if self.on_committed is not None and not job.urgent:  # in-flight intervals stay local
                try:
                    self.on_committed(info)
                except Exception:
                    pass  # publication is best effort; its own failures are reported by its queue
            return Completion(job.key, True, None, info.path, done.bytes_written, time.perf_counter() - t0, job.namespace,
                              n, entry)
        except Exception as exc:
            exc.__traceback__ = None  # frames hold views; the job keeps them alive
            return Completion(job.key, False, exc, None, 0, time.perf_counter() - t0, job.namespace, n)
