"""Persisting one checkpoint as format 2: new blocks first, then its manifest.

1. Cut the span tensors into blocks on the fixed grid and name each by the
   BLAKE3 of its bytes (no I/O).
2. Claim those names in the catalogue: from now on no process frees them,
   and the claim says which are already on disk (and which another process
   is unlinking right now: those are written once it is done).
3. Write only the missing blocks (temp, fsync, rename; a batch written before
   its fsyncs: blocks.write_many), fsync the blocks directory, record them
   (they count against the SSD cap from here on).
4. Unless an identical manifest is already stored, write the manifest under
   a new name and commit it: one transaction checks that the claims still
   hold, records the row and its block references, ends the claims, and
   renames the manifest into place last.

A kill -9 anywhere leaves either no new manifest or one whose blocks are
all durable; blocks nobody references are freed by the survivors once they
find this process dead, or by gc. Writer thread only; numpy views, no MLX.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...host.system import fsync_dir
from ..catalog.database import CatalogBusy
from ..faults import fault
from . import blocks
from . import format as fmt
from .blocks import BlockRef
from .store import CheckpointStore


FREEING_WAIT_S = 60.0  # at most this long for another process to finish unlinking a block we need


@dataclass
class Persisted:
    info: fmt.FileInfo
    bytes_written: int  # blocks and manifest actually written
    bytes_deduplicated: int  # block (and manifest) bytes that were already stored


def _inline_digests(job) -> list[str]:
    out = []
    for h in job.host_tensors:
        if not getattr(h, "span", False):
            d = fmt.hasher(fmt.FORMAT_VERSION)
            d.update(memoryview(np.ascontiguousarray(h.array).reshape(-1).view(np.uint8)))
            out.append(d.hexdigest())
    return out


def _same_as_stored(store: CheckpointStore, job, refs: list[BlockRef]) -> fmt.FileInfo | None:
    """The stored manifest of these tokens, if it holds exactly this state."""
    info = store.file_info(job.namespace, job.tokens)
    h = info.header if info is not None else None
    same = h is not None and (h.version == fmt.FORMAT_VERSION and h.blocks == tuple(refs) and h.layout == job.layout
                              and h.identity == job.identity and h.min_reusable_offset == job.min_reusable_offset
                              and h.trimmable == job.trimmable and [t.digest for t in h.inline] == _inline_digests(job))
    return info if same else None


def _wait_freed(store: CheckpointStore, names: dict) -> None:
    """Blocks a process (another, or this one's keeper) is unlinking right now: write them only
    once it is done. The error names whoever holds the marks."""
    deadline = time.monotonic() + FREEING_WAIT_S
    while names:
        if time.monotonic() > deadline:
            holders = sorted({store.catalog.describe(o) for o in names.values()})
            raise CatalogBusy(f"{len(names)} blocks are still being removed by {', '.join(holders)}")
        time.sleep(0.01)
        names = store.catalog.being_freed(names)


def persist(store: CheckpointStore, job, *, pause: Callable[[], None] | None = None,
            progress: Callable[[int, int], None] | None = None,
            block_tokens: int | None = None) -> Persisted:
    t0 = time.perf_counter()
    block_tokens = block_tokens or blocks.BLOCK_TOKENS
    path = store.prepare_path(job.namespace, job.tokens)  # first: a directory that cannot be made fails at once
    span = [h for h in job.host_tensors if getattr(h, "span", False)]
    specs = [(h.name, h.dtype, tuple(h.shape)) for h in span]
    views = blocks.SpanViews([h.array for h in span])
    planned = []  # (ref, head, data)
    for a, b in blocks.spans(len(job.tokens), block_tokens) if span else ():
        if pause is not None:
            pause()
        head, data = blocks.header(a, b, specs), views.runs(a, b)
        planned.append((BlockRef(blocks.name_of(head, data), a, b, len(head) + sum(len(d) for d in data)), head, data))
    refs = [r for r, _, _ in planned]
    names = [r.name for r in refs]
    write_id = time.monotonic_ns()
    missing, freeing = store.catalog.reserve_blocks(names, write_id)
    committed = False
    try:
        fault("write.claimed")
        _wait_freed(store, store.catalog.being_freed(freeing))
        to_write = {r.name: (r, head, data) for r, head, data in planned
                    if r.name in missing or not blocks.block_path(store.blocks_root, r.name).exists()}
        total = sum(r.nbytes for r, _, _ in to_write.values())
        inline_bytes = sum(h.nbytes for h in job.host_tensors if not getattr(h, "span", False))
        done = [0]

        def landed(size: int) -> None:
            done[0] += size
            if progress is not None:
                progress(done[0], total + inline_bytes)

        blocks.write_many([(blocks.block_path(store.blocks_root, r.name), head, data)
                           for r, head, data in to_write.values()], pause, store.anchor, landed)
        if to_write:  # one directory holds every block: one fsync makes their renames durable
            fsync_dir(store.blocks_root)
            fault("write.blocks_synced")
            store.catalog.add_blocks({r.name: r.nbytes for r, _, _ in to_write.values()})
        saved = sum(r.nbytes for r in refs) - total
        stored = _same_as_stored(store, job, refs) if not to_write else None
        if stored is not None:
            return Persisted(stored, 0, saved + stored.file_bytes)
        info = fmt.write_checkpoint(
            path,
            identity=job.identity, namespace=job.namespace, tokens=job.tokens, layout=job.layout,
            min_reusable_offset=job.min_reusable_offset, host_tensors=job.host_tensors, codec=job.codec,
            trimmable=job.trimmable, pause=pause, blocks=refs, root=store.anchor,
            progress=None if progress is None else (lambda d, _t: progress(total + d, total + inline_bytes)),
            commit=lambda tmp, info: store.commit(tmp, info, write_id, names),
        )
        committed = True
        info = fmt.FileInfo(info.path, info.header, info.file_bytes, info.raw_bytes, time.perf_counter() - t0)
        return Persisted(info, total + info.file_bytes, saved)
    finally:
        if not committed:
            try:
                store.release(write_id)
            except Exception:  # never hide the error that got us here; the keeper retries
                store.catalog.later(lambda: store.release(write_id))
