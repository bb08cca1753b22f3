"""Checkpoint files: format 2 manifests (written) and format 1 files (still read).

Layout::

    0      magic b"MLXCKPT\\n", uint32 version, uint32 header capacity,
           uint32 header length, 4 reserved bytes, digest of the header
           JSON (32 bytes)                                   (56 bytes)
    56     header: UTF-8 JSON, padded with spaces to its capacity
    16 KiB aligned: inline tensor data, one tensor after another, each at
           a 16 KiB aligned offset, raw or as one zstd frame

Format 1 holds every tensor inline, SHA-256 checked. Format 2 is a manifest:
tensors that are token spans (`span`) live in shared blocks (blocks.py)
that its header lists; exact-boundary state (recurrent, a wrapped ring,
attachments) stays inline; every digest is BLAKE3. The header is sized up
front (every number at its widest, hashes fixed width), so it can be
patched last without moving data. Readers reject versions they do not know
rather than guess.

Bytes only: writers run on a worker thread and see numpy views, never MLX
arrays; readers fill caller-provided buffers. What a layer's state means
(`layout`, `trimmable`) is the codecs' business, stored here as given.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import blake3
import numpy as np

from .blocks import BlockRef
from ...errors import CorruptCheckpoint, NewerFormat  # noqa: F401 (raised here; defined in errors.py)

MAGIC = b"MLXCKPT\n"
FORMAT_VERSION = 2  # what this build writes, and the newest it reads
LEGACY_VERSION = 1  # whole files, SHA-256: read until they age out
ALIGN = 16 * 1024
CHUNK = 4 * 1024 * 1024  # hashing/IO step between pause() calls
_PREFIX = struct.Struct("<8sIII4x32s")
CODECS = ("raw", "zstd")
# Measured in benchmarks/bench_storage.py: fp32 KV barely compresses (~7%)
# while zstd costs several times the write and restore time. Raw wins.
DEFAULT_CODEC = "raw"
ZSTD_LEVEL = 1

# numpy dtype that carries each logical dtype's bits on disk
_HOST_DTYPES = {
    "float32": "<f4", "float16": "<f2", "bfloat16": "<u2", "float64": "<f8", "bool": "?",
    "int8": "i1", "uint8": "u1", "int16": "<i2", "uint16": "<u2",
    "int32": "<i4", "uint32": "<u4", "int64": "<i8", "uint64": "<u8",
}

_REQUIRED = (
    "identity", "namespace", "tokens", "layout", "min_reusable_offset", "trimmable", "attachments", "created", "tensors",
)



def hasher(version: int):
    """The digest of a format version: SHA-256 (1) or BLAKE3 (2); both 32 bytes."""
    return hashlib.sha256() if version == LEGACY_VERSION else blake3.blake3()


def host_dtype(name: str) -> np.dtype:
    try:
        return np.dtype(_HOST_DTYPES[name])
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {name!r}") from None


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple
    offset: int
    stored_bytes: int
    raw_bytes: int
    codec: str
    digest: str  # hex; "" for span tensors (their blocks are named by content)
    span: bool = False  # stored in blocks, not inline

    def to_json(self, version: int = FORMAT_VERSION) -> dict:
        d = dict(self.__dict__)
        d["shape"] = list(self.shape)
        d["sha256" if version == LEGACY_VERSION else "blake3"] = d.pop("digest")
        if version == LEGACY_VERSION:
            del d["span"]
        return d


@dataclass(frozen=True)
class Header:
    version: int
    identity: dict
    namespace: str
    tokens: tuple
    layout: list
    min_reusable_offset: int
    trimmable: bool
    attachments: list
    created: float
    tensors: tuple  # of TensorEntry
    file_size: int
    blocks: tuple = ()  # of BlockRef, in token order (format 2)

    @property
    def raw_bytes(self) -> int:
        return sum(t.raw_bytes for t in self.tensors)

    @property
    def block_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    @property
    def inline(self) -> tuple:
        return tuple(t for t in self.tensors if not t.span)

    @property
    def span_tensors(self) -> tuple:
        return tuple(t for t in self.tensors if t.span)


@dataclass(frozen=True)
class FileInfo:
    path: Path
    header: Header
    file_bytes: int
    raw_bytes: int
    seconds: float


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN




def _parse_header(doc: dict, version: int, file_size: int) -> Header:
    try:
        missing = [k for k in _REQUIRED if k not in doc]
        if missing:
            raise CorruptCheckpoint(f"header misses fields {missing}")
        legacy = version == LEGACY_VERSION
        tensors = tuple(
            TensorEntry(
                str(t["name"]), str(t["dtype"]), tuple(int(s) for s in t["shape"]),
                int(t["offset"]), int(t["stored_bytes"]), int(t["raw_bytes"]),
                str(t["codec"]), str(t["sha256" if legacy else "blake3"]), False if legacy else bool(t["span"]),
            )
            for t in doc["tensors"]
        )
        return Header(
            version,
            dict(doc["identity"]),
            str(doc["namespace"]),
            tuple(int(t) for t in doc["tokens"]),
            list(doc["layout"]),
            int(doc["min_reusable_offset"]),
            bool(doc["trimmable"]),
            list(doc["attachments"]),
            float(doc["created"]),
            tensors,
            file_size,
            tuple(BlockRef.from_json(b) for b in doc.get("blocks", ())),
        )
    except CorruptCheckpoint:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpoint(f"malformed header field: {e!r}") from None


def _check_table(h: Header, data_start: int) -> None:
    end = data_start
    if len({t.name for t in h.tensors}) != len(h.tensors):
        raise CorruptCheckpoint("duplicate tensor names")
    _check_blocks(h)
    for t in sorted(h.inline, key=lambda t: t.offset):
        if t.codec not in CODECS:
            raise CorruptCheckpoint(f"tensor {t.name}: unknown codec {t.codec!r}")
        try:
            itemsize = host_dtype(t.dtype).itemsize
        except ValueError:
            raise CorruptCheckpoint(f"tensor {t.name}: unknown dtype {t.dtype!r}") from None
        if any(s < 0 for s in t.shape) or t.raw_bytes != int(np.prod(t.shape, dtype=np.int64)) * itemsize:
            raise CorruptCheckpoint(f"tensor {t.name}: size does not match shape")
        if t.codec == "raw" and t.stored_bytes != t.raw_bytes:
            raise CorruptCheckpoint(f"tensor {t.name}: raw size mismatch")
        if t.offset % ALIGN or t.offset < end or t.stored_bytes < 0:
            raise CorruptCheckpoint(f"tensor {t.name}: bad offset")
        if len(t.digest) != 64:
            raise CorruptCheckpoint(f"tensor {t.name}: bad hash")
        end = t.offset + t.stored_bytes
        if end > h.file_size:
            raise CorruptCheckpoint(f"truncated: tensor {t.name} ends at {end}, file has {h.file_size} bytes")


def _check_blocks(h: Header) -> None:
    """Span tensors hold every token, and the blocks cover [0, tokens) in order."""
    n = len(h.tokens)
    for t in h.span_tensors:
        if len(t.shape) < 2 or t.shape[-2] != n or t.codec != "raw" or t.dtype not in _HOST_DTYPES:
            raise CorruptCheckpoint(f"tensor {t.name}: not a span of {n} tokens")
        if t.raw_bytes != int(np.prod(t.shape, dtype=np.int64)) * host_dtype(t.dtype).itemsize:
            raise CorruptCheckpoint(f"tensor {t.name}: size does not match shape")
    if not h.span_tensors:
        if h.blocks:
            raise CorruptCheckpoint("blocks listed without span tensors")
        return
    at = 0
    for b in h.blocks:
        if b.start != at or b.end <= b.start or b.nbytes <= 0:
            raise CorruptCheckpoint("blocks do not cover the tokens in order")
        at = b.end
    if at != n:
        raise CorruptCheckpoint(f"blocks cover {at} of {n} tokens")


def read_header(source) -> Header:
    """Read and validate only the header (no tensor bytes); `source` is a path or an open fd."""
    if not isinstance(source, int):
        fd = os.open(source, os.O_RDONLY)
        try:
            return read_header(fd)
        finally:
            os.close(fd)
    size = os.fstat(source).st_size
    prefix = os.pread(source, _PREFIX.size, 0)
    if len(prefix) < _PREFIX.size:
        raise CorruptCheckpoint("truncated before the header")
    magic, version, capacity, length, digest = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise CorruptCheckpoint("wrong magic: not a checkpoint file")
    if version > FORMAT_VERSION:
        raise NewerFormat(f"format version {version} (this build reads up to {FORMAT_VERSION})")
    if version not in (LEGACY_VERSION, FORMAT_VERSION):
        raise CorruptCheckpoint(f"unsupported format version {version}")
    if length > capacity:
        raise CorruptCheckpoint("header length exceeds its capacity")
    body = os.pread(source, length, _PREFIX.size)
    if len(body) < length or size < _PREFIX.size + capacity:
        raise CorruptCheckpoint("truncated header")
    check = hasher(version)
    check.update(body)
    if check.digest() != digest:
        raise CorruptCheckpoint("header checksum mismatch")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpoint(f"header is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpoint("header is not a JSON object")
    h = _parse_header(doc, version, size)
    _check_table(h, _align(_PREFIX.size + capacity))
    return h
