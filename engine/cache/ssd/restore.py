"""Restore from SSD: verified reads straight into MLX-owned buffers.

Plain KV's keys and values each get an MLX allocation of their own with room
to grow (`layers.growth_room`): the borrower that takes a restored entry over
(a hit after a restart) appends there in place, as into the live cache that
made it, instead of copying the prefix. Other tensors of one dtype and shape
share one allocation. None is zeroed (`empty_buffer`); each is read into
through a numpy view of that memory (verified on the format's reader pool),
then the checkpoint is rebuilt from the header's layout. Any
problem is a miss (`CheckpointUnavailable`) and the file goes to quarantine.

A `Restore` is one such read split by thread: `Restore(store, entry)` opens
the file and allocates the buffers and `finish()` builds the checkpoint, on
the owner (MLX) thread; `fill()`, the I/O and verification, runs on any
thread (the reader thread of ../prefetch.py). `restore()` does all three in
a row.
"""

from __future__ import annotations

import io
import threading
import weakref
from collections import Counter

import mlx.core as mx
import numpy as np

from ...kv.checkpoint import Checkpoint
from ...kv.codecs import CODECS
from ...kv.layers import growth_room
from . import format as fmt
from .index import IndexEntry
from .store import CheckpointStore

_MX_NAMES = {"bool": "bool_"}


class _Slot:
    """A file-like `.npy` of `shape` for `mx.load` whose data it never writes.

    MLX allocates the array and asks for all its bytes in one `readinto`;
    answering without writing leaves the memory as the allocator gave it.
    `mx.zeros` (and `mx.empty`, its alias) writes every byte instead: on a
    fresh process that is a first-touch page fault per 4 KiB page from user
    space, 0.7 s/GB measured here, where the kernel faults the same pages
    in for about a third of that while a read fills them.
    """

    closed = False

    def __init__(self, dtype: np.dtype, shape: tuple):
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                    "fortran_order": False, "shape": tuple(shape)})
        self.head, self.nbytes = head.getvalue(), int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.pos = self.claimed = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.head) + self.nbytes + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, mv) -> int:
        n = len(mv)
        if self.pos < len(self.head):  # the header: MLX parses it
            n = min(n, len(self.head) - self.pos)
            mv[:n] = self.head[self.pos : self.pos + n]
        else:
            self.claimed += n
        self.pos += n
        return n


def empty_buffer(dtype: str, shape) -> mx.array:
    """An evaluated MLX array for a stored tensor (bfloat16 as its uint16 bits) whose bytes
    are not written: every byte is overwritten, and verified, before anyone sees it."""
    host = fmt.host_dtype(dtype)
    slot = _Slot(host, tuple(shape))
    released = threading.Event()
    weakref.finalize(slot, released.set)
    try:
        a = mx.load(slot, format="npy")
    except Exception:
        a = None
    whole = slot.claimed == slot.nbytes
    del slot
    # MLX drops its reader of the slot on a worker thread that needs the GIL: wait for it
    # here, or a process exiting meanwhile can abort in that thread (seen with a slot
    # slow to answer: 11 exits in 12).
    released.wait(5.0)
    if a is None or not whole:  # an MLX that reads .npy some other way: zeroed memory
        a = mx.zeros(tuple(shape), dtype=mx.uint16 if dtype == "bfloat16" else getattr(mx, _MX_NAMES.get(dtype, dtype)))
        mx.eval(a)
    return a


class Restore:
    def __init__(self, store: CheckpointStore, entry: IndexEntry, *, touch: bool = True):
        """Open `entry` and allocate its buffers (owner thread); CheckpointUnavailable on a miss.
        touch=False: a prefetch, not a use of the file."""
        self.entry = entry
        self._groups: dict = {}  # (dtype, shape) -> [mx array of every such tensor, numpy view, next index]
        self._keep: list = []  # (name, dtype, mx array, positions): the tensors (or the buffers they begin)
        self.read = store.open_read(entry, touch=touch)
        h = self.read.header
        self._room = {t.name: growth_room(t.shape[-2]) for t in _growing(h)}
        counts = Counter((t.dtype, tuple(t.shape)) for t in h.tensors if t.name not in self._room)
        for (dtype, shape), k in counts.items():
            group = empty_buffer(dtype, (k, *shape))
            self._groups[(dtype, shape)] = [group, np.asarray(group), 0]  # the view keeps the array alive
        self.read.allocate(self._allocate)

    def fill(self, progress=None) -> bool:
        """Read and verify (any thread); False when it failed (finish() then says why). progress(done,
        total) in tokens, on this thread as each block lands."""
        return self.read.fill(progress)

    def finish(self) -> Checkpoint:
        """The restored checkpoint (owner thread), or CheckpointUnavailable."""
        try:
            return self.read.finish(self._build)
        finally:
            self._keep, self._groups = [], {}

    def close(self) -> None:
        """Give up: release the file and the buffers (owner thread)."""
        self.read.close()
        self._keep, self._groups = [], {}

    def _allocate(self, name, dtype, shape):
        if name in self._room:  # a buffer of its own with room: a borrower taking it over appends there
            n = shape[-2]
            whole = empty_buffer(dtype, (*shape[:-2], n + self._room[name], shape[-1]))
            self._keep.append((name, dtype, whole, n))
            return np.asarray(whole)
        group = self._groups[(dtype, tuple(shape))]
        i = group[2]
        group[2] += 1
        self._keep.append((name, dtype, group[0][i : i + 1].squeeze(0), None))  # a view (group[0][i] would copy)
        return group[1][i]

    def _build(self, h: fmt.Header) -> Checkpoint:
        tensors, parents = {}, {}
        for name, dtype, a, n in self._keep:
            a = a.view(mx.bfloat16) if dtype == "bfloat16" else a
            if n is None:
                tensors[name] = a
            else:
                parents[name], tensors[name] = a, a[..., :n, :]
        mx.eval(list(tensors.values()))
        return Checkpoint.from_tensors(h.tokens, h.layout, tensors, min_reusable_offset=h.min_reusable_offset,
                                       parents=parents)


def _growing(h: fmt.Header) -> list:
    """The span tensors of layers whose borrower takes the restored buffers over (plain KV)."""
    kinds = {f"layers.{i}.": spec.get("kind") for i, spec in enumerate(h.layout)}
    return [t for t in h.span_tensors if getattr(CODECS.get(kinds.get(t.name[: t.name.rfind(".") + 1])),
                                                 "grows_in_place", False)]


def restore(store: CheckpointStore, entry: IndexEntry) -> Checkpoint:
    """Open, read and build on this (the owner) thread."""
    r = Restore(store, entry)
    r.fill()
    return r.finish()
