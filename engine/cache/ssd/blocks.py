"""Format 2 blocks: immutable files of KV token spans, named by the BLAKE3 of their bytes.

    root/blocks/<64 hex>.blk      (one flat directory: a write fsyncs it once)

A block holds, for one span [start, end) of token positions, the slice
[..., start:end, :] of every span tensor of a checkpoint (see
HostTensor.span), in the manifest's tensor order::

    magic b"MLXBLK2\\n", uint32 header length, header JSON
    {"start", "end", "tensors": [[name, dtype, shape of the slice], ...]},
    then each slice's bytes in C order, back to back.

The name is the BLAKE3 of the whole file: a block is verified by hashing what
was read, and the same KV stored twice (a rerun, a conversation that grew, a
second question over one document) is one file. Spans follow a fixed grid
from position 0, so every checkpoint of a prefix cuts it the same way; only
the last block of a checkpoint may be short. Readers read a block whole,
read its slices straight into the full tensors' buffers and hash them there.
Bytes only: no MLX, no catalogue (store.py decides what exists).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import mmap
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import blake3
import numpy as np

from ...host.safe_dirs import Dir
from ...host.system import fsync_file, process_tag
from ..faults import fault
from ...errors import CorruptBlock  # noqa: F401 (raised here; defined in errors.py)

MAGIC = b"MLXBLK2\n"
_PREFIX = struct.Struct("<8sI")
SUFFIX = ".blk"
# Tokens per block, chosen in benchmarks/bench_blocks.py (docs/benchmarks.md). A
# chat turn rewrites its last, partial block: a 20-turn chat wrote 1.43x its
# final KV with 32 tokens, 1.86x with 64, 2.8x with 128. 32 tokens of SmolLM2
# are 1.5 MB, inside the 1-4 MB a Redis value does best with, and a 1.5k-token
# prompt is 48 files.
BLOCK_TOKENS = 32
_IOV_MAX = 512  # iovecs per preadv/writev call (Linux allows 1024)
WRITEBACK_BATCH = 16  # blocks written (their writeback started) before the first of them is fsynced



@dataclass(frozen=True)
class BlockRef:
    """A manifest's reference to one block: its name, token span and size in bytes."""

    name: str
    start: int
    end: int
    nbytes: int

    def to_json(self) -> list:
        return [self.name, self.start, self.end, self.nbytes]

    @classmethod
    def from_json(cls, v) -> "BlockRef":
        name, start, end, nbytes = v
        if not (isinstance(name, str) and len(name) == 64 and all(c in "0123456789abcdef" for c in name)):
            raise ValueError(f"bad block name {name!r}")
        return cls(name, int(start), int(end), int(nbytes))


def spans(n_tokens: int, block_tokens: int = BLOCK_TOKENS) -> list[tuple[int, int]]:
    return [(a, min(a + block_tokens, n_tokens)) for a in range(0, n_tokens, block_tokens)]


def block_path(root: Path, name: str) -> Path:
    return Path(root) / (name + SUFFIX)


def header(start: int, end: int, tensors: Sequence[tuple[str, str, tuple]]) -> bytes:
    """The block's prefix and header, from the full tensors' (name, dtype, shape)."""
    body = b'{"start":%d,"end":%d,"tensors":%s}' % (start, end, _tensors_json(end - start, tuple(
        (name, dtype, tuple(shape)) for name, dtype, shape in tensors)))
    return _PREFIX.pack(MAGIC, len(body)) + body


@functools.lru_cache(maxsize=256)
def _tensors_json(span: int, tensors: tuple) -> bytes:
    # the same for every full block of a checkpoint: JSON-encoding it once saves ~70 us a block
    return json.dumps([[name, dtype, [*shape[:-2], span, shape[-1]]] for name, dtype, shape in tensors],
                      separators=(",", ":")).encode()


class SpanViews:
    """Byte views of span tensors, cut into blocks' runs without copying.

    Cache buffers are padded along the token axis, so the slice [..., a:b, :]
    of a tensor is one contiguous run per leading index (batch, head). The
    per-lead views are made once; a block's runs are then memoryview slices
    (cheap: a 1.5k-token restore touches thousands of runs). Writable when
    the arrays are. A tensor held in pieces along the token axis (an object
    with `parts`, see kv.checkpoint.Pieces) gives one run per piece a block
    overlaps.
    """

    def __init__(self, arrays: Sequence):
        self._tensors = []  # per tensor: per piece (first, end position, per-lead flat uint8 views, bytes per token)
        for a in arrays:
            pieces, at = [], 0
            for p in getattr(a, "parts", None) or (a,):
                pieces.append((at, at + p.shape[-2], self._leads(p), p.shape[-1] * p.itemsize))
                at += p.shape[-2]
            self._tensors.append(pieces)

    @staticmethod
    def _leads(a: np.ndarray) -> list[memoryview]:
        row = a.shape[-1] * a.itemsize
        if a.flags.c_contiguous:
            flat = memoryview(a.reshape(-1).view(np.uint8))
            step = a.shape[-2] * row
            return [flat[i * step : (i + 1) * step] for i in range(a.size * a.itemsize // step if step else 0)]
        views = []
        for idx in np.ndindex(*a.shape[:-2]):
            sub = a[idx]
            if not sub.flags.c_contiguous:  # an unusual layout: pack it (never a read buffer)
                sub = np.ascontiguousarray(sub)
            views.append(memoryview(sub.reshape(-1).view(np.uint8)))
        return views

    def runs(self, start: int, end: int) -> list[memoryview]:
        """The runs of block [start, end), in file order."""
        out = []
        for pieces in self._tensors:
            cut = [(max(start, a) - a, min(end, b) - a, views, row) for a, b, views, row in pieces if a < end and b > start]
            for lead in range(len(pieces[0][2])):
                out += [views[lead][lo * row : hi * row] for lo, hi, views, row in cut]
        return out


def name_of(head: bytes, data: Sequence[memoryview]) -> str:
    h = blake3.blake3(head)
    for mv in data:
        h.update(mv)
    return h.hexdigest()


def write(path: Path, head: bytes, data: Sequence[memoryview], pause: Callable[[], None] | None = None,
          root: Path | None = None) -> int:
    """Write one block atomically (temp, fsync, rename; the caller fsyncs the directory).

    Returns its size. Replacing an existing block is harmless: same name, same bytes.
    root: where links stop being followed (default: above the blocks directory, host/safe_dirs.py).
    """
    write_many([(path, head, data)], pause, root)
    return len(head) + sum(len(mv) for mv in data)


def write_many(items: Sequence[tuple], pause: Callable[[], None] | None = None, root: Path | None = None,
               landed: Callable[[int], None] | None = None) -> None:
    """Write blocks (path, head, data) of one directory, each atomically (temp, fsync, rename; the
    caller fsyncs the directory), WRITEBACK_BATCH at a time: a batch's temp files are written with
    their writeback started at once, then each is fsynced and renamed. The disk writes a block back
    while the next ones are written instead of the writer waiting for each in turn (an fsync per
    block as it was written: 3x slower here). landed(size) after each rename."""
    if not items:
        return
    parent = items[0][0].parent
    with Dir(parent, parent.parent if root is None else root, create=True) as d:
        for i in range(0, len(items), WRITEBACK_BATCH):
            temps = []  # [fd, temp name, path, size], in order
            try:
                for path, head, data in items[i : i + WRITEBACK_BATCH]:
                    tmp = f".{path.name}.{process_tag()}.{os.urandom(4).hex()}.tmp"  # the tag: whose it is
                    temps.append([d.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), tmp, path,
                                  len(head) + sum(len(mv) for mv in data)])
                    _writev_all(temps[-1][0], [memoryview(head)] + list(data), pause)
                    fault("block.written")
                    _start_writeback(temps[-1][0])
                while temps:
                    fd, tmp, path, size = temps[0]
                    try:
                        fsync_file(fd)
                    finally:
                        os.close(fd)
                        temps[0][0] = -1
                    fault("block.synced")
                    d.replace(tmp, d, path.name)
                    temps.pop(0)
                    fault("block.renamed")
                    if landed is not None:
                        landed(size)
            finally:  # what was not renamed goes (an error, a cancelled write)
                for fd, tmp, _, _ in temps:
                    if fd >= 0:
                        os.close(fd)
                    d.unlink(tmp)


def _start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a file's dirty pages back now, without waiting (PostgreSQL's
    pg_flush_data does the same where sync_file_range is missing); its fsync then finds them written."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _writev_all(fd: int, bufs: list, pause) -> None:
    for i in range(0, len(bufs), _IOV_MAX):
        if pause is not None:
            pause()
        batch = bufs[i : i + _IOV_MAX]
        want = sum(len(b) for b in batch)
        done = os.writev(fd, batch)
        if done < want:  # a short write: finish the rest one buffer at a time
            for b in batch:
                if done >= len(b):
                    done -= len(b)
                    continue
                view = b[done:]
                while len(view):
                    view = view[os.write(fd, view):]
                done = 0


_RUNS_PER_READ = 64  # runs read (preadv) and then hashed at a time: about a MiB, still in cache when hashed


def read_runs(path: Path, name: str, head: bytes, runs: Sequence[memoryview]) -> None:
    """Read block `name` straight into `runs` (where its slices go, in file order: SpanViews.runs of
    the buffers being filled), hashing each batch of runs as it lands, then verify. FileNotFoundError
    when it is gone; CorruptBlock on any difference (the runs then hold what was read).

    One copy from the page cache into the destination and one pass of BLAKE3 over it: no staging
    buffer. pread and the hash release the GIL, so reader threads overlap.
    """
    want = len(head) + sum(len(r) for r in runs)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != want:
            raise CorruptBlock(name, f"{size} bytes, expected {want}")
        got_head = bytearray(len(head))
        at = _preadv_all(fd, [memoryview(got_head)], 0, name)
        digest = blake3.blake3(got_head)
        for i in range(0, len(runs), _RUNS_PER_READ):
            batch = runs[i : i + _RUNS_PER_READ]
            at = _preadv_all(fd, batch, at, name)
            for r in batch:
                digest.update(r)
    finally:
        os.close(fd)
    if digest.hexdigest() != name:
        raise CorruptBlock(name, "BLAKE3 mismatch")
    if bytes(got_head) != head:
        raise CorruptBlock(name, "header does not match its manifest")


def _preadv_all(fd: int, views: Sequence[memoryview], offset: int, name: str) -> int:
    """Fill every view from `offset` on; the offset after them."""
    views = list(views)
    while views:
        n = os.preadv(fd, views, offset)
        if not n:
            raise CorruptBlock(name, "short read")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    return offset


GOOD, CORRUPT, UNREADABLE = "good", "corrupt", "unreadable"  # the answers of intact()


def intact(path: Path, name: str) -> str:
    """Whether the file at `path` holds what block `name` names, read whole from the disk (not
    the page cache: a bad copy there is not the disk's) and hashed again: GOOD; CORRUPT,
    verified (it holds other bytes); or UNREADABLE (an I/O error, or gone): a miss and a
    retry, never evidence of corruption. Fault point `block.confirm`."""
    try:
        fault("block.confirm")
        digest = _uncached_digest(path)
    except OSError:
        return UNREADABLE
    return GOOD if digest == name else CORRUPT


def _uncached_digest(path: Path) -> str:
    """BLAKE3 of the file as the disk holds it: O_DIRECT where the filesystem allows it (into a
    page-aligned buffer), else after POSIX_FADV_DONTNEED drops its clean cached pages; on
    macOS with F_NOCACHE."""
    direct = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_RDONLY | direct)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:  # (tmpfs, some FUSE: no direct I/O)
            raise
        fd, direct = os.open(path, os.O_RDONLY), 0
    buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT needs
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if sys.platform == "darwin":
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
        h = blake3.blake3()
        while True:
            try:
                n = os.readv(fd, [buf])
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~direct)  # read it through the
                direct = 0  # page cache then, its pages dropped above
                continue
            if not n:
                return h.hexdigest()
            h.update(memoryview(buf)[:n])
    finally:
        os.close(fd)
        buf.close()


def fill_from_value(value, name: str, head: bytes, dst: Sequence[np.ndarray]) -> None:
    """The same from a block held in memory that was verified against its name already (a value
    RemoteTier.get_blocks returned: it hashes each one). Not hashed a second time (~0.15 s at 8k
    tokens); its size and header are still checked against where it goes."""
    buf = np.frombuffer(value, np.uint8)
    if len(buf) != len(head) + sum(d.nbytes for d in dst):
        raise CorruptBlock(name, "value does not match its manifest")
    _copy_checked(buf, name, head, dst)


def _copy_checked(buf: np.ndarray, name: str, head: bytes, dst: Sequence[np.ndarray]) -> None:
    if bytes(buf[: len(head)]) != head:
        raise CorruptBlock(name, "header does not match its manifest")
    offset = len(head)
    for d in dst:
        np.copyto(d, buf[offset : offset + d.nbytes].view(d.dtype).reshape(d.shape))
        offset += d.nbytes
