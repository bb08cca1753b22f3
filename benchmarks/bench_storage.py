"""Checkpoint write/restore speed and size: ours (raw, zstd) vs mlx-lm.

Prints one JSON document. KV comes from a real SmolLM2 prefill when a
converted model is found (MLXCACHE_BENCH_MODEL or /tmp/models/...), else
random normal float32 (a poor proxy for compressibility). Longer contexts
than the prefill are made by tiling the real KV along time (same value
distribution, no extra prefill minutes).

    .venv/bin/python benchmarks/bench_storage.py [--tokens 1536 8192] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as lm_cache

from common import default_model, prompt_tokens

from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.cache.ssd.restore import restore
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore

LAYERS, HEADS, HEAD_DIM = 30, 3, 64
IDENTITY = {"artifact": "bench", "config": "c", "tokenizer": "t", "kv_scheme": "fp32"}
def real_kv(n_prefill: int):
    """Per-layer (keys, values) of shape (1, H, n, D) from a real prefill of the default model."""
    from mlx_lm import load

    path = default_model()
    model, tok = load(path)
    ids = prompt_tokens(tok, n_prefill)
    caches = lm_cache.make_prompt_cache(model)
    for i in range(0, len(ids), 512):
        model(mx.array(ids[i : i + 512])[None], cache=caches)
        mx.eval([c.state for c in caches])
    kv = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]
    mx.eval(kv)
    return kv, path


def make_checkpoint(n: int, base_kv):
    caches = []
    for layer in range(LAYERS):
        if base_kv is not None:
            k, v = base_kv[layer]
            reps = -(-n // k.shape[2])
            k = mx.concatenate([k] * reps, axis=2)[..., :n, :]
            v = mx.concatenate([v] * reps, axis=2)[..., :n, :]
        else:
            k = mx.random.normal((1, HEADS, n, HEAD_DIM))
            v = mx.random.normal((1, HEADS, n, HEAD_DIM))
        c = lm_cache.KVCache()
        c.update_and_fetch(k, v)
        caches.append(c)
    return Checkpoint.capture(list(range(1, n + 1)), caches)


def drop_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, repeat, before=None):
    ts = []
    for _ in range(repeat):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return round(statistics.median(ts) * 1000, 2)


def floor_ms(path, repeat, cold):
    """max(sequential read into a fresh buffer, one-thread SHA-256) of the file's bytes."""
    size = os.path.getsize(path)

    def read():
        buf = np.empty(size, np.uint8)
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))
        return buf

    read_ms = timed(read, repeat, before=(lambda: drop_cache(path)) if cold else None)
    data = read()
    hash_ms = timed(lambda: hashlib.sha256(memoryview(data)).digest(), repeat)
    return read_ms, hash_ms


def bench(n: int, base_kv, repeat: int, d: Path) -> dict:
    cp = make_checkpoint(n, base_kv)
    hts = cp.host_tensors()
    raw = sum(h.nbytes for h in hts)
    store = CheckpointStore(d / f"store{n}")
    store.register_namespace("bench", IDENTITY)
    out = {"tokens": n, "raw_bytes": raw}
    entries = {}
    for codec in ("raw", "zstd"):
        path = store.prepare_path("bench", cp.tokens)

        def write():
            info = fmt.write_checkpoint(path, identity=IDENTITY, namespace="bench", tokens=cp.tokens,
                                        layout=cp.layout(), min_reusable_offset=0, host_tensors=hts,
                                        trimmable=cp.trimmable, codec=codec)
            entries[codec] = info

        out[f"write_{codec}_ms"] = timed(write, repeat)
        out[f"file_{codec}_bytes"] = entries[codec].file_bytes
        e = store.publish(entries[codec])
        out[f"restore_{codec}_warm_ms"] = timed(lambda: restore(store, e), repeat)
        out[f"restore_{codec}_cold_ms"] = timed(lambda: restore(store, e), repeat, before=lambda: drop_cache(path))
        if codec == "raw":
            r = restore(store, e)
            assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(r.arrays(), cp.arrays()))
            out["floor_warm_read_ms"], out["floor_hash_ms"] = floor_ms(path, repeat, cold=False)
            out["floor_cold_read_ms"], _ = floor_ms(path, repeat, cold=True)
            out["floor_warm_ms"] = max(out["floor_warm_read_ms"], out["floor_hash_ms"])
            out["floor_cold_ms"] = max(out["floor_cold_read_ms"], out["floor_hash_ms"])
    out["zstd_ratio"] = round(out["file_zstd_bytes"] / out["file_raw_bytes"], 4)

    lm_path = str(d / f"mlxlm{n}.safetensors")
    caches = cp.lend()
    out["write_mlxlm_ms"] = timed(lambda: lm_cache.save_prompt_cache(lm_path, caches), repeat)
    out["file_mlxlm_bytes"] = os.path.getsize(lm_path)

    def lm_load():
        c = lm_cache.load_prompt_cache(lm_path)
        mx.eval([x.state for x in c])

    out["restore_mlxlm_warm_ms"] = timed(lm_load, repeat)
    out["restore_mlxlm_cold_ms"] = timed(lm_load, repeat, before=lambda: drop_cache(lm_path))
    for t in ("warm", "cold"):
        out[f"restore_raw_{t}_vs_floor"] = round(out[f"restore_raw_{t}_ms"] / out[f"floor_{t}_ms"], 3)
        out[f"restore_raw_{t}_vs_mlxlm"] = round(out[f"restore_raw_{t}_ms"] / out[f"restore_mlxlm_{t}_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1536, 8192])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory on the SSD to test (default: a temp dir)")
    ap.add_argument("--synthetic", action="store_true", help="skip the model; random normal KV")
    args = ap.parse_args()
    base_kv, model = (None, None) if args.synthetic else real_kv(min(args.tokens))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        results = [bench(n, base_kv, args.repeat, Path(d)) for n in args.tokens]
    print(json.dumps({
        "kv_source": f"real prefill of {model} ({min(args.tokens)} tokens; longer = tiled)" if model else "random normal float32",
        "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "cpus": os.cpu_count(),
        "notes": "ours = temp file + fsync + rename + dir fsync; restore = read + SHA-256 verify of every tensor; "
                 "mlx-lm save does not fsync, load does not verify",
        "results": results,
    }, indent=1))


if __name__ == "__main__":
    main()
