"""Verified reads of format-1 files: every tensor into a buffer the caller
allocates (numpy views of MLX memory on restore), read and SHA-256 checked
on a 2-thread pool. Bytes only: no MLX here.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from .format import CorruptCheckpoint, Header, TensorEntry

_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(2, thread_name_prefix="ckpt-read")
    return _POOL


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


def _load_one(fd: int, t: TensorEntry, mv: memoryview) -> None:
    # pread, zstd and sha256 all drop the GIL: two of these run in parallel
    if t.codec == "raw":
        _pread_exact(fd, mv, t.offset, t.name)
    else:
        _decompress_into(fd, t, mv)
    if hashlib.sha256(mv).hexdigest() != t.sha256:
        raise CorruptCheckpoint(f"tensor {t.name}: SHA-256 mismatch")


def read_tensors(source, header: Header, allocate: Callable) -> dict:
    """Read every tensor into buffers from `allocate(name, dtype, shape)`; `source` is
    a path or the open fd the header came from (one file, even if it is replaced meanwhile).

    The buffers must be writable and C-contiguous (views of MLX-owned memory
    on restore: one copy from the file). `allocate` runs on the calling
    thread; reading and SHA-256 verification run on a 2-thread pool, so
    tensor i is read and hashed while tensor i+1 is allocated. Raises
    CorruptCheckpoint on any mismatch; buffer contents are then undefined.
    """
    out = {}
    futures = []
    fd = source if isinstance(source, int) else os.open(source, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            # Start the kernel's readahead of the whole file now: a cold read
            # then overlaps the hashing instead of alternating with it.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        pool = _pool()
        for t in header.tensors:
            buf = allocate(t.name, t.dtype, t.shape)
            if not (isinstance(buf, np.ndarray) and buf.flags.c_contiguous and buf.flags.writeable) or buf.nbytes != t.raw_bytes:
                raise ValueError(f"allocate returned an unusable buffer for {t.name}")
            mv = memoryview(buf.reshape(-1).view(np.uint8))
            futures.append(pool.submit(_load_one, fd, t, mv))
            out[t.name] = buf
    finally:
        errors = []
        for fut in futures:  # never return (or close fd) while a pool thread uses a buffer
            try:
                fut.result()
            except Exception as e:
                errors.append(e)
        if fd is not source:
            os.close(fd)
    if errors:
        raise errors[0]
    return out
