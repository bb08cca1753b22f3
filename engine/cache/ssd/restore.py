"""Restore from SSD: verified reads straight into MLX-owned buffers.

Each tensor is read into an evaluated `mx.empty` buffer through a numpy view
of its memory (one copy from the file; verified on the format's reader
pool), then the checkpoint is rebuilt from the header's layout. Any problem
is a miss (`CheckpointUnavailable`) and the file goes to quarantine.

A `Restore` is one such read split by thread: `Restore(store, entry)` opens
the file and allocates the buffers and `finish()` builds the checkpoint, on
the owner (MLX) thread; `fill()`, the I/O and verification, runs on any
thread (the reader thread of ../prefetch.py). `restore()` does all three in
a row.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...kv.checkpoint import Checkpoint
from . import format as fmt
from .index import IndexEntry
from .store import CheckpointStore

_MX_NAMES = {"bool": "bool_"}


def empty_buffer(dtype: str, shape) -> mx.array:
    """An unevaluated MLX buffer for a stored tensor (bfloat16 as its uint16 bits): every
    byte is overwritten, and verified, before anyone sees it, so it is not zeroed."""
    return mx.empty(shape, dtype=mx.uint16 if dtype == "bfloat16" else getattr(mx, _MX_NAMES.get(dtype, dtype)))


class Restore:
    def __init__(self, store: CheckpointStore, entry: IndexEntry, *, touch: bool = True):
        """Open `entry` and allocate its buffers (owner thread); CheckpointUnavailable on a miss.
        touch=False: a prefetch, not a use of the file."""
        self.entry = entry
        self._keep: list = []  # (name, dtype, mx array): the memory the numpy views point into
        self.read = store.open_read(entry, touch=touch)
        self.read.allocate(self._allocate)

    def fill(self) -> bool:
        """Read and verify (any thread); False when it failed (finish() then says why)."""
        return self.read.fill()

    def finish(self) -> Checkpoint:
        """The restored checkpoint (owner thread), or CheckpointUnavailable."""
        try:
            return self.read.finish(self._build)
        finally:
            self._keep = []

    def close(self) -> None:
        """Give up: release the file and the buffers (owner thread)."""
        self.read.close()
        self._keep = []

    def _allocate(self, name, dtype, shape):
        host = fmt.host_dtype(dtype)
        a = empty_buffer(dtype, shape)
        mx.eval(a)
        self._keep.append((name, dtype, a))
        view = np.asarray(a)
        assert view.dtype.itemsize == host.itemsize
        return view

    def _build(self, h: fmt.Header) -> Checkpoint:
        tensors = {name: a.view(mx.bfloat16) if dtype == "bfloat16" else a for name, dtype, a in self._keep}
        mx.eval(list(tensors.values()))
        return Checkpoint.from_tensors(h.tokens, h.layout, tensors, min_reusable_offset=h.min_reusable_offset)


def restore(store: CheckpointStore, entry: IndexEntry) -> Checkpoint:
    """Open, read and build on this (the owner) thread."""
    r = Restore(store, entry)
    r.fill()
    return r.finish()
