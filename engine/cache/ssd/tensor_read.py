"""Verified reads of checkpoints: every tensor into a buffer the caller
allocates (numpy views of MLX memory on restore), inline tensors from the
file, span tensors from their blocks, read and hashed on a pool of READERS
threads while the disk reads AHEAD blocks in advance. Bytes only: no MLX here.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

from . import blocks
from .blocks import BlockRef
from .header import CorruptCheckpoint, Header, TensorEntry, hasher

# Threads that read and hash blocks (straight into the tensors: blocks.read_runs), one per core
# this process may use (2 to 8): a GB restore is CPU-bound (the kernel's copies and faults, then
# BLAKE3 over every byte), so each core hashes what it read. On 2 cores 3, 4 or 8 threads measured
# the same as 2. Block files asked of the disk ahead of them (POSIX_FADV_WILLNEED) keep reads in
# flight when the page cache is cold. Measured in benchmarks/bench_storage.py and
# benchmarks/bench_scale.py (docs/benchmarks.md).
READERS = max(2, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2))
AHEAD = 16
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers != READERS:
        _POOL = ThreadPoolExecutor(READERS, thread_name_prefix="ckpt-read")
    return _POOL


def _advise(path: Path) -> None:
    """Start reading a whole file into the page cache (asynchronously)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # the read itself reports it
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def _pread_exact(fd: int, mv: memoryview, offset: int, name: str) -> None:
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        if not n:
            raise CorruptCheckpoint(f"truncated: tensor {name}")
        got += n


def _decompress_into(fd: int, t: TensorEntry, mv: memoryview) -> None:
    import zstandard

    src = bytearray(t.stored_bytes)
    _pread_exact(fd, memoryview(src), t.offset, t.name)
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(bytes(src))
        got = 0
        while got < len(mv):
            n = reader.readinto(mv[got:])
            if not n:
                break
            got += n
        extra = reader.read(1)
    except zstandard.ZstdError as e:
        raise CorruptCheckpoint(f"tensor {t.name}: zstd error {e}") from None
    if got != len(mv) or extra:
        raise CorruptCheckpoint(f"tensor {t.name}: decompressed size mismatch")


def _load_one(fd: int, t: TensorEntry, mv: memoryview, version: int) -> None:
    # pread, zstd and the digests all drop the GIL: two of these run in parallel
    if t.codec == "raw":
        _pread_exact(fd, mv, t.offset, t.name)
    else:
        _decompress_into(fd, t, mv)
    digest = hasher(version)
    digest.update(mv)
    if digest.hexdigest() != t.digest:
        raise CorruptCheckpoint(f"tensor {t.name}: {'SHA-256' if version == 1 else 'BLAKE3'} mismatch")


def _load_block(root: Path, ref: BlockRef, head: bytes, runs: list, ahead: BlockRef | None) -> None:
    if ahead is not None:
        _advise(blocks.block_path(root, ahead.name))
    try:
        blocks.read_runs(blocks.block_path(root, ref.name), ref.name, head, runs)
    except FileNotFoundError:
        raise MissingBlock(ref.name) from None  # (any other OSError is an I/O error: a miss, not corruption)


class MissingBlock(Exception):
    """A block the manifest names is not on disk: the checkpoint is a miss (nothing is corrupt)."""

    def __init__(self, name: str):
        super().__init__(f"block {name[:16]} is missing")
        self.name = name


def allocate_all(header: Header, allocate: Callable) -> dict:
    """Buffers for every tensor from `allocate(name, dtype, shape)` (the caller's thread): C-contiguous
    and writable, of the tensor's shape, or for a span tensor (token positions along axis -2) longer
    along that axis (room the state grows into later; the tensor is its first positions)."""
    out = {}
    for t in header.tensors:
        buf = allocate(t.name, t.dtype, t.shape)
        fits = isinstance(buf, np.ndarray) and buf.flags.c_contiguous and buf.flags.writeable and (
            buf.nbytes == t.raw_bytes if not t.span else
            buf.ndim == len(t.shape) >= 2 and buf.shape[:-2] == tuple(t.shape[:-2])
            and buf.shape[-1] == t.shape[-1] and buf.shape[-2] >= t.shape[-2]
            and buf.itemsize * int(np.prod(t.shape, dtype=np.int64)) == t.raw_bytes)
        if not fits:
            raise ValueError(f"allocate returned an unusable buffer for {t.name}")
        out[t.name] = buf
    return out


def fill(source, header: Header, buffers: dict, blocks_root: Path | None = None,
         progress: Callable[[int, int], None] | None = None) -> None:
    """Read and verify every tensor into `buffers` (from allocate_all); any thread.

    Inline tensors come from `source` (a path or the open fd the header came
    from: one file, even if it is replaced meanwhile), span tensors from their
    blocks, every tensor or block on the READERS-thread pool, each hashed as it
    lands; progress(tokens done, tokens) on the calling thread as blocks land. Raises
    CorruptCheckpoint, CorruptBlock (carrying the block) or MissingBlock; buffer
    contents are then undefined.
    """
    fd = source if isinstance(source, int) else os.open(source, os.O_RDONLY)
    futures = []
    try:
        if hasattr(os, "posix_fadvise"):
            # Start the kernel's readahead of the whole file now: a cold read
            # then overlaps the hashing instead of alternating with it.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        pool = _pool()
        for t in header.inline:
            mv = memoryview(buffers[t.name].reshape(-1).view(np.uint8))
            futures.append(pool.submit(_load_one, fd, t, mv, header.version))
        spanned = header.span_tensors
        if spanned:
            if blocks_root is None:
                raise ValueError("a format-2 checkpoint needs its blocks directory")
            views = blocks.SpanViews([buffers[t.name] for t in spanned])
            specs = [(t.name, t.dtype, t.shape) for t in spanned]
            refs = list(header.blocks)  # (they cover the tensors' positions exactly: header.py checks)
            for ref in refs[:AHEAD]:
                _advise(blocks.block_path(blocks_root, ref.name))
            for i, ref in enumerate(refs):
                head = blocks.header(ref.start, ref.end, specs)
                ahead = refs[i + AHEAD] if i + AHEAD < len(refs) else None
                futures.append(pool.submit(_load_block, blocks_root, ref, head, views.runs(ref.start, ref.end), ahead))
    finally:
        errors, n = [], len(header.tokens)
        for i, fut in enumerate(futures):  # never return (or close fd) while a pool thread uses a buffer
            try:
                fut.result()
            except Exception as e:
                errors.append(e)
            if progress is not None and not errors:
                progress(n * (i + 1) // len(futures), n)
        if fd is not source:
            os.close(fd)
    if errors:
        raise errors[0]


def read_tensors(source, header: Header, allocate: Callable, blocks_root: Path | None = None) -> dict:
    """allocate_all, then fill (on restore, the buffers are views of MLX-owned memory: one copy
    from the disk)."""
    buffers = allocate_all(header, allocate)
    fill(source, header, buffers, blocks_root)
    return buffers
