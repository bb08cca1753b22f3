"""Restore from SSD: verified reads straight into MLX-owned buffers.

Each tensor is read into an evaluated `mx.empty` buffer through a numpy view
of its memory (one copy from the file; SHA-256 verified on the format's
reader pool), then the checkpoint is rebuilt from the header's layout. Owner
(MLX) thread only. Any problem is a miss (`CheckpointUnavailable`) and the
file goes to quarantine.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ...kv.checkpoint import Checkpoint
from . import format as fmt
from .index import IndexEntry
from .store import CheckpointStore

_MX_NAMES = {"bool": "bool_"}


def restore(store: CheckpointStore, entry: IndexEntry) -> Checkpoint:
    keep = []  # mx arrays whose memory the numpy views point into

    def allocate(name, dtype, shape):
        host = fmt.host_dtype(dtype)
        # every byte is overwritten (and verified) before anyone sees it: no need to zero it
        a = mx.empty(shape, dtype=mx.uint16 if dtype == "bfloat16" else getattr(mx, _MX_NAMES.get(dtype, dtype)))
        mx.eval(a)
        keep.append((name, dtype, a))
        view = np.asarray(a)
        assert view.dtype.itemsize == host.itemsize
        return view

    def build(h: fmt.Header) -> Checkpoint:
        tensors = {name: a.view(mx.bfloat16) if dtype == "bfloat16" else a for name, dtype, a in keep}
        mx.eval(list(tensors.values()))
        return Checkpoint.from_tensors(h.tokens, h.layout, tensors, min_reusable_offset=h.min_reusable_offset)

    return store.read(entry, allocate, build)
