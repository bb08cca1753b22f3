"""Checkpoint file format 1: round trips and every kind of corruption."""

import os
import stat
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.cache.ssd.tensor_read import read_tensors

IDENTITY = {"artifact": "a" * 64, "config": "c1", "tokenizer": "t1", "kv_scheme": "fp"}


def make_checkpoint(n_tokens=40, layers=3, heads=2, head_dim=8, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    caches = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, n_tokens, head_dim)).astype(dtype)
        v = mx.random.normal((1, heads, n_tokens, head_dim)).astype(dtype)
        c.update_and_fetch(k, v)
        caches.append(c)
    return Checkpoint.capture(list(range(100, 100 + n_tokens)), caches)


def write(path, cp, codec="raw", **kw):
    return fmt.write_checkpoint(
        path,
        identity=IDENTITY,
        namespace="ns",
        tokens=cp.tokens,
        layout=cp.layout(),
        min_reusable_offset=cp.min_reusable_offset,
        host_tensors=cp.host_tensors(),
        codec=codec,
        trimmable=cp.trimmable,
        **kw,
    )


def read_all(path):
    h = fmt.read_header(path)
    return h, read_tensors(path, h, lambda n, dt, sh: np.empty(sh, fmt.host_dtype(dt)))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_round_trip(tmp_path, codec, dtype):
    cp = make_checkpoint(n_tokens=240, dtype=dtype)  # 240 of 256: published as views, not compacted
    hts = cp.host_tensors()
    assert not hts[0].array.flags.c_contiguous  # capacity-padded buffer slice
    p = tmp_path / "x.ckpt"
    info = write(p, cp, codec=codec)
    assert info.raw_bytes == sum(h.nbytes for h in hts)
    h, out = read_all(p)
    assert [t.name for t in h.tensors] == [x.name for x in hts]
    for x in hts:
        t = next(t for t in h.tensors if t.name == x.name)
        assert t.dtype == str(dtype).removeprefix("mlx.core.")
        assert t.codec == codec and t.offset % fmt.ALIGN == 0
        assert np.array_equal(out[x.name], x.array)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_header_only(tmp_path):
    cp = make_checkpoint(n_tokens=17)
    p = tmp_path / "x.ckpt"
    write(p, cp)
    h = fmt.read_header(p)
    assert h.tokens == cp.tokens and h.identity == IDENTITY and h.namespace == "ns"
    assert h.layout == cp.layout() and h.trimmable and h.min_reusable_offset == 0
    assert h.version == fmt.FORMAT_VERSION and h.attachments == []
    assert h.raw_bytes == sum(x.nbytes for x in cp.host_tensors())


def test_contiguous_and_empty_tensors(tmp_path):
    class HT:
        def __init__(self, name, arr):
            self.name, self.dtype, self.shape, self.array = name, str(arr.dtype), arr.shape, arr

    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    hts = [HT("layers.0.0", a), HT("layers.0.1", np.zeros((1, 2, 0, 4), np.float32))]
    p = tmp_path / "x.ckpt"
    fmt.write_checkpoint(p, identity={}, namespace="n", tokens=[1], layout=[], min_reusable_offset=0, host_tensors=hts, trimmable=True)
    _, out = read_all(p)
    assert np.array_equal(out["layers.0.0"], a) and out["layers.0.1"].shape == (1, 2, 0, 4)


def _corrupt_reason(p):
    with pytest.raises(fmt.CorruptCheckpoint) as ei:
        read_all(p)
    return ei.value.reason


@pytest.mark.parametrize("where", ["prefix", "header", "data_start", "mid_tensor", "last_byte"])
def test_truncated(tmp_path, where):
    cp = make_checkpoint()
    p = tmp_path / "x.ckpt"
    write(p, cp)
    h = fmt.read_header(p)
    size = os.path.getsize(p)
    cut = {
        "prefix": 10,
        "header": 100,
        "data_start": h.tensors[0].offset,
        "mid_tensor": h.tensors[1].offset + h.tensors[1].stored_bytes // 2,
        "last_byte": size - 1,
    }[where]
    os.truncate(p, cut)
    assert "truncated" in _corrupt_reason(p)


def _flip(p, offset):
    with open(p, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_flipped_header_byte(tmp_path):
    cp = make_checkpoint()
    p = tmp_path / "x.ckpt"
    write(p, cp)
    _flip(p, 200)  # inside the JSON: may still parse, the header checksum catches it
    assert "checksum" in _corrupt_reason(p)


def test_flipped_tensor_byte(tmp_path):
    cp = make_checkpoint()
    p = tmp_path / "x.ckpt"
    write(p, cp)
    h = fmt.read_header(p)
    _flip(p, h.tensors[2].offset + 5)
    assert "BLAKE3" in _corrupt_reason(p) and h.tensors[2].name in _corrupt_reason(p)


def test_flipped_zstd_byte(tmp_path):
    cp = make_checkpoint()
    p = tmp_path / "x.ckpt"
    write(p, cp, codec="zstd")
    h = fmt.read_header(p)
    _flip(p, h.tensors[0].offset + h.tensors[0].stored_bytes // 2)
    _corrupt_reason(p)


def test_wrong_magic_and_future_version(tmp_path):
    cp = make_checkpoint()
    p = tmp_path / "x.ckpt"
    write(p, cp)
    data = bytearray(p.read_bytes())
    bad = tmp_path / "magic.ckpt"
    bad.write_bytes(b"NOTACKPT" + data[8:])
    assert "magic" in _corrupt_reason(bad)
    future = tmp_path / "future.ckpt"
    future.write_bytes(data[:8] + struct.pack("<I", fmt.FORMAT_VERSION + 1) + data[12:])
    with pytest.raises(fmt.NewerFormat, match="version"):  # a newer build's file: not corrupt, not ours
        read_all(future)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    assert "truncated" in _corrupt_reason(empty)


def test_pause_and_progress(tmp_path):
    cp = make_checkpoint(n_tokens=64)
    calls, seen = [], []
    write(tmp_path / "x.ckpt", cp, pause=lambda: calls.append(len(seen)), progress=lambda d, t: seen.append((d, t)))
    assert calls == list(range(len(seen)))  # before every chunk, nothing written yet at the first
    assert seen[-1][0] == seen[-1][1] == sum(x.nbytes for x in cp.host_tensors())


def test_failed_write_leaves_nothing(tmp_path):
    cp = make_checkpoint()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(OSError):
        write(tmp_path / "file" / "x.ckpt", cp)  # a path component is a regular file
    bad = [h for h in cp.host_tensors()]
    bad[0] = type(bad[0])(bad[0].name, "float16", bad[0].shape, bad[0].array)  # dtype lies about the view
    with pytest.raises(ValueError):
        fmt.write_checkpoint(tmp_path / "y.ckpt", identity={}, namespace="n", tokens=cp.tokens,
                             layout=cp.layout(), min_reusable_offset=0, host_tensors=bad, trimmable=True)
    assert os.listdir(tmp_path) == ["file"]
