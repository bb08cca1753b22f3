"""Writing checkpoint files (the layout and the reading side: header.py).

Bytes only: writers run on a worker thread and see numpy views, never MLX
arrays. `format` stays the one name callers use: it re-exports header.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ...host import safe_dirs
from ...host.system import fsync_dir, fsync_file, process_tag
from ..faults import fault
from .blocks import BlockRef
from .header import (  # noqa: F401  (re-exported: callers use fmt.<name>)
    _PREFIX, ALIGN, CHUNK, CODECS, DEFAULT_CODEC, FORMAT_VERSION, LEGACY_VERSION, MAGIC, ZSTD_LEVEL,
    CorruptCheckpoint, FileInfo, Header, NewerFormat, TensorEntry, _align, _parse_header, hasher, host_dtype,
    read_header,
)

def _header_json(fields: dict, tensors: Iterable[TensorEntry], version: int) -> bytes:
    doc = dict(fields)
    doc["tensors"] = [t.to_json(version) for t in tensors]
    return json.dumps(doc, separators=(",", ":")).encode()


def temp_path_for(path: Path) -> Path:
    """A temp file beside `path`, named with this process's tag (its writer can be told dead)."""
    return path.with_name(f".{path.name}.{process_tag()}.{time.monotonic_ns()}.tmp")


def _rename_durably(tmp: Path, info: "FileInfo", root: Path) -> None:
    safe_dirs.replace(tmp, info.path, root)
    fsync_dir(Path(info.path).parent)


# --- writing ----------------------------------------------------------------


def write_checkpoint(
    path,
    *,
    identity: dict,
    namespace: str,
    tokens: Sequence[int],
    layout: list,
    min_reusable_offset: int,
    host_tensors: Sequence,
    trimmable: bool,
    codec: str = DEFAULT_CODEC,
    progress: Callable[[int, int], None] | None = None,
    pause: Callable[[], None] | None = None,
    commit: Callable[[Path, "FileInfo"], None] | None = None,
    blocks: Sequence[BlockRef] = (),
    version: int = FORMAT_VERSION,
    root: Path | None = None,
) -> FileInfo:
    """Write one checkpoint atomically (temp file, fsync, rename, dir fsync).

    Format 2 (the default) writes a manifest: span tensors are not written
    here but named by `blocks`, which must already be durable. version=1
    writes a legacy whole file (kept for compatibility tests).

    Runs on a worker thread; `host_tensors` are HostTensor-like objects
    (name, dtype, shape, array). `pause()` is called before every chunk: the
    writer's yield rule blocks there while it must not compete. On any
    error the temp file is removed and the exception propagates; the final
    path is untouched. `commit(temp, info)` renames the finished temp file to
    `info.path` and makes that durable (default: rename, fsync the directory;
    the store records it in the same catalogue transaction). root: the directory below
    which no link is followed (default: above the namespace's directory).
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    if version not in (LEGACY_VERSION, FORMAT_VERSION):
        raise ValueError(f"cannot write format version {version}")
    t0 = time.perf_counter()
    path = Path(path)
    root = path.parent.parent if root is None else root  # links below it are never followed (host/safe_dirs.py)
    attachments = [h.name.removeprefix("attachments.") for h in host_tensors if h.name.startswith("attachments.")]
    fields = {
        "identity": dict(identity),
        "namespace": namespace,
        "tokens": [int(t) for t in tokens],
        "layout": layout,
        "min_reusable_offset": int(min_reusable_offset),
        "trimmable": bool(trimmable),
        "attachments": attachments,
        "created": time.time(),
    }
    in_blocks = version != LEGACY_VERSION and bool(blocks)
    if version != LEGACY_VERSION:
        fields["blocks"] = [b.to_json() for b in blocks]
    spanned = [h for h in host_tensors if in_blocks and getattr(h, "span", False)]
    inline = [h for h in host_tensors if not (in_blocks and getattr(h, "span", False))]
    span_entries = [TensorEntry(h.name, h.dtype, tuple(int(s) for s in h.shape), 0, 0, int(h.array.nbytes), "raw", "",
                                True) for h in spanned]
    # Size the header with every variable field at its widest.
    widest = [
        TensorEntry(h.name, h.dtype, tuple(h.shape), 10**19, 10**19, 10**19, "zstd", "0" * 64)
        for h in inline
    ]
    capacity = len(_header_json(fields, widest + span_entries, version)) + 256
    data_start = _align(_PREFIX.size + capacity)
    total = sum(int(h.array.nbytes) for h in inline)
    done = 0

    tmp = temp_path_for(path)
    with safe_dirs.Dir(path.parent, root) as d:
        fd = d.open(tmp.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            entries = []
            offset = data_start
            scratch = None  # reused for strided tensors
            for h in inline:
                arr = h.array
                want = host_dtype(h.dtype)
                if arr.dtype.itemsize != want.itemsize or tuple(arr.shape) != tuple(h.shape):
                    raise ValueError(f"tensor {h.name}: view does not match its dtype/shape")
                nbytes = int(arr.nbytes)
                if arr.flags.c_contiguous:
                    mv = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                else:
                    if scratch is None or scratch.nbytes < nbytes:
                        scratch = np.empty(max(nbytes, 1), np.uint8)
                    packed = scratch[:nbytes].view(arr.dtype).reshape(arr.shape)
                    np.copyto(packed, arr)
                    mv = memoryview(scratch)[:nbytes]
                f.seek(offset)
                digest = hasher(version)
                cobj = None
                if codec == "zstd":
                    import zstandard

                    cobj = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compressobj(size=nbytes)
                stored = 0
                for lo in range(0, nbytes, CHUNK):
                    if pause is not None:
                        pause()
                    chunk = mv[lo : lo + CHUNK]
                    digest.update(chunk)
                    if cobj is None:
                        f.write(chunk)
                        stored += len(chunk)
                    else:
                        out = cobj.compress(chunk)
                        f.write(out)
                        stored += len(out)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, total)
                if cobj is not None:
                    out = cobj.flush()
                    f.write(out)
                    stored += len(out)
                del mv
                entries.append(
                    TensorEntry(h.name, h.dtype, tuple(int(s) for s in h.shape), offset, stored, nbytes, codec, digest.hexdigest())
                )
                offset = _align(offset + stored)
            end = entries[-1].offset + entries[-1].stored_bytes if entries else _PREFIX.size + capacity
            f.truncate(end)
            by_name = {e.name: e for e in entries + span_entries}
            entries = [by_name[h.name] for h in host_tensors]
            body = _header_json(fields, entries, version)
            assert len(body) <= capacity
            f.seek(0)
            head_digest = hasher(version)
            head_digest.update(body)
            f.write(_PREFIX.pack(MAGIC, version, capacity, len(body), head_digest.digest()))
            f.write(body + b" " * (capacity - len(body)))
            fault("manifest.written")
            fsync_file(f.fileno())
        fault("manifest.synced")
        header = _parse_header(dict(fields, tensors=[e.to_json(version) for e in entries]), version, end)
        info = FileInfo(path, header, end, header.raw_bytes, time.perf_counter() - t0)
        (commit or (lambda t, i: _rename_durably(t, i, root)))(tmp, info)
    except BaseException:
        safe_dirs.unlink(tmp, root)
        raise
    return info


# --- reading ----------------------------------------------------------------
