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
hash it, and copy its slices straight into the full tensors' buffers.
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
import threading
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
    with Dir(path.parent, path.parent.parent if root is None else root, create=True) as d:
        tmp = f".{path.name}.{process_tag()}.{os.urandom(4).hex()}.tmp"  # the tag: whose it is
        fd = d.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            _writev_all(fd, [memoryview(head)] + list(data), pause)
            fault("block.written")
            fsync_file(fd)
            os.close(fd)
            fd = -1
            fault("block.synced")
            d.replace(tmp, d, path.name)
            fault("block.renamed")
        except BaseException:
            if fd >= 0:
                os.close(fd)
            d.unlink(tmp)
            raise
    return len(head) + sum(len(mv) for mv in data)


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


_staging = threading.local()


def _staging_buffer(n: int) -> np.ndarray:
    buf = getattr(_staging, "buf", None)
    if buf is None or buf.nbytes < n:
        # Anonymous memory of its own: numpy asks huge pages for large arrays, and a
        # huge page's first-touch fault costs far more than 512 small ones here (measured).
        buf = _staging.buf = np.frombuffer(mmap.mmap(-1, max(n, 4 << 20)), np.uint8)
    return buf[:n]


def read_into(path: Path, name: str, head: bytes, dst: Sequence[np.ndarray]) -> None:
    """Read block `name` and copy its slices into `dst` (the full tensors' [..., a:b, :]
    views), verified first. FileNotFoundError when it is gone; CorruptBlock on any difference.

    The file is read whole into a per-thread buffer and hashed in one call:
    BLAKE3 is several times faster on one large input than on the many
    small runs of a strided destination, and pread, the hash and numpy's
    copies all release the GIL, so two reader threads overlap.
    """
    want = len(head) + sum(d.nbytes for d in dst)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != want:
            raise CorruptBlock(name, f"{size} bytes, expected {want}")
        buf = _staging_buffer(want)
        got = 0
        while got < want:
            n = os.preadv(fd, [memoryview(buf[got:])], got)
            if not n:
                raise CorruptBlock(name, "short read")
            got += n
    finally:
        os.close(fd)
    if blake3.blake3(buf).hexdigest() != name:
        raise CorruptBlock(name, "BLAKE3 mismatch")
    _copy_checked(buf, name, head, dst)


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
