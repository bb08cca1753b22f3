"""Storage speed at the disk's floor: format 2 writes and verified restores vs mlx-lm.

    .venv/bin/python benchmarks/bench_storage.py [--tokens 1536 8192] [--repeat 5] [--readers 1 2 4 8]

KV comes from a real SmolLM2 prefill (tiled along time past its length), or
random normal float32 with --synthetic. For each length:

- write: our persist (format 2: BLAKE3-named blocks, manifest, fsync, rename)
  vs mlx-lm `save_prompt_cache` (no fsync), in this process, medians.
- restore, each in a fresh process, medians of --repeat, page cache warm or
  dropped (posix_fadvise DONTNEED per file after fsync; `echo 3 >
  /proc/sys/vm/drop_caches` also works here, as root, but would empty every
  other process's cache too): ours (`restore()`, every byte verified) and
  mlx-lm `load_prompt_cache` (verifies nothing), both timed by one wall clock
  from the call to the arrays being evaluated; and the floor of a verified
  read, BLAKE3 floor: the same block files read into one fresh buffer and
  hashed on two threads, no MLX. Targets: ours / mlx-lm <= 1.0 (goal 0.7).
- readers (dropped cache, the longest length): ours with 1, 2, 4, 8 reader
  threads (reader.READERS).
- peak RSS of a restore of the longest length in a process that loaded the
  model first: ru_maxrss / (RSS before the restore + the state's bytes);
  target <= 1.1.

Prints one JSON document; `cat /proc/loadavg` is recorded with it.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import default_model, emit, median, prompt_tokens

LAYERS, HEADS, HEAD_DIM = 30, 3, 64
NS, IDENTITY = "bench", {"artifact": "bench-storage"}


def real_kv(n_prefill: int):
    """Per-layer (keys, values) of shape (1, H, n, D) from a real prefill of the default model,
    and the model's path."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models import cache as lm_cache

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


def make_caches(n: int, base_kv) -> list:
    """mlx-lm caches holding n tokens (the real KV tiled, or random)."""
    import mlx.core as mx
    from mlx_lm.models import cache as lm_cache

    caches = []
    for layer in range(LAYERS):
        if base_kv is not None:
            k, v = base_kv[layer]
            reps = -(-n // k.shape[2])
            k = mx.concatenate([k] * reps, axis=2)[..., :n, :]
            v = mx.concatenate([v] * reps, axis=2)[..., :n, :]
        else:
            k, v = mx.random.normal((1, HEADS, n, HEAD_DIM)), mx.random.normal((1, HEADS, n, HEAD_DIM))
        c = lm_cache.KVCache()
        c.update_and_fetch(k, v)
        caches.append(c)
    return caches


def make_checkpoint(n: int, base_kv):
    """A published checkpoint of tokens 1..n over `make_caches`."""
    from mlxcache_kernel.engine.kv.checkpoint import Checkpoint

    return Checkpoint.capture(list(range(1, n + 1)), make_caches(n, base_kv))


def drop_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _ours(d: Path) -> list[Path]:
    return [p for p in (d / "ours").rglob("*") if p.is_file() and p.suffix in (".blk", ".ckpt")]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- one measurement in a fresh process ------------------------------------------


def _child(kind: str, d: Path, dropped: bool, readers: int, with_model: bool) -> dict:
    import mlx.core as mx

    out = {}
    if with_model:  # the model first, as a kernel restoring a cell's state has it
        from mlx_lm import load

        model, _ = load(default_model())
        mx.eval(model.parameters())
        out["rss_before"] = _rss_bytes()
    if kind == "ours":
        from mlxcache_kernel.engine.cache.ssd import tensor_read as reader
        from mlxcache_kernel.engine.cache.ssd.restore import restore
        from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore

        reader.READERS = readers
        store = CheckpointStore(d / "ours")
        store.register_namespace(NS, IDENTITY)
        [entry] = store.entries()
        if dropped:
            for p in _ours(d):
                drop_cache(p)
        t0 = time.perf_counter()
        cp = restore(store, entry)
        mx.eval(cp.arrays())
        out["ms"] = (time.perf_counter() - t0) * 1e3
        out["state_bytes"] = cp.kv_bytes
    elif kind == "mlxlm":
        from mlx_lm.models import cache as lm_cache

        path = d / "mlxlm.safetensors"
        if dropped:
            drop_cache(path)
        t0 = time.perf_counter()
        caches = lm_cache.load_prompt_cache(str(path))
        mx.eval([c.state for c in caches])
        out["ms"] = (time.perf_counter() - t0) * 1e3
    else:  # floor: the block bytes read into one fresh buffer and hashed, two threads
        import blake3
        import numpy as np

        files = sorted(p for p in _ours(d) if p.suffix == ".blk")
        if dropped:
            for p in files:
                drop_cache(p)
        t0 = time.perf_counter()
        sizes = [p.stat().st_size for p in files]
        buf = np.frombuffer(mmap.mmap(-1, sum(sizes)), np.uint8)  # not np.empty: no huge pages, as MLX
        starts = np.cumsum([0] + sizes[:-1])

        def one(i):
            mv = memoryview(buf[starts[i] : starts[i] + sizes[i]])
            with open(files[i], "rb", buffering=0) as f:
                f.readinto(mv)
            blake3.blake3(mv).digest()

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(one, range(len(files))))
        out["ms"] = (time.perf_counter() - t0) * 1e3
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _fresh(kind: str, d: Path, temp: str, readers: int = 2, with_model: bool = False) -> dict:
    r = subprocess.run([sys.executable, __file__, "_child", kind, str(d), temp, str(readers), str(int(with_model))],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _median_ms(kind, d, temp, repeat, readers=2) -> float:
    return round(median([_fresh(kind, d, temp, readers)["ms"] for _ in range(repeat)]), 2)


# --- the cases ---------------------------------------------------------------------


def bench_length(n: int, base_kv, args, d: Path) -> dict:
    from mlx_lm.models import cache as lm_cache

    from mlxcache_kernel.engine.cache.ssd.persist import persist
    from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
    from mlxcache_kernel.engine.cache.ssd.writer import WriteJob
    from mlxcache_kernel.engine.kv.checkpoint import Checkpoint

    caches = make_caches(n, base_kv)
    cp = Checkpoint.capture(list(range(1, n + 1)), caches)
    row = {"tokens": n, "kv_bytes": cp.kv_bytes}
    writes, saves = [], []
    for i in range(args.repeat):  # the first copy is the one restored; the others only time writes
        store = CheckpointStore(d / ("ours" if i == 0 else f"w{i}"))
        store.register_namespace(NS, IDENTITY)
        job = WriteJob.from_checkpoint(cp, NS, IDENTITY)
        t0 = time.perf_counter()
        done = persist(store, job)
        writes.append((time.perf_counter() - t0) * 1e3)
        store.publish(done.info)
        store.close()
        t0 = time.perf_counter()
        lm_cache.save_prompt_cache(str(d / ("mlxlm" if i == 0 else f"w{i}")) + ".safetensors", caches)
        saves.append((time.perf_counter() - t0) * 1e3)
    row["write_ms"], row["mlxlm_save_ms"] = round(median(writes), 2), round(median(saves), 2)
    for i in range(1, args.repeat):
        shutil.rmtree(d / f"w{i}")
        os.unlink(d / f"w{i}.safetensors")
    row["file_bytes"] = sum(p.stat().st_size for p in _ours(d))
    for temp in ("warm", "dropped"):
        for kind in ("ours", "mlxlm", "floor"):
            row[f"{kind}_{temp}_ms"] = _median_ms(kind, d, temp, args.repeat)
        row[f"{temp}_ours_over_mlxlm"] = round(row[f"ours_{temp}_ms"] / row[f"mlxlm_{temp}_ms"], 3)
        row[f"{temp}_ours_over_floor"] = round(row[f"ours_{temp}_ms"] / row[f"floor_{temp}_ms"], 3)
    return row


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        kind, d, temp, readers, with_model = sys.argv[2:7]
        print(json.dumps(_child(kind, Path(d), temp == "dropped", int(readers), with_model == "1")))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1536, 8192])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--readers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    ap.add_argument("--synthetic", action="store_true", help="random normal KV instead of a real prefill")
    args = ap.parse_args()
    base_kv = None if args.synthetic else real_kv(min(args.tokens))[0]
    rows = []
    for n in args.tokens:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            d = Path(d)
            row = bench_length(n, base_kv, args, d)
            if n == max(args.tokens):
                row["dropped_ms_by_readers"] = {r: _median_ms("ours", d, "dropped", args.repeat, r)
                                                for r in args.readers}
                peaks = [_fresh("ours", d, "warm", with_model=True) for _ in range(args.repeat)]
                ratio = median([p["peak_rss"] / (p["rss_before"] + p["state_bytes"]) for p in peaks])
                row["peak_rss_over_model_plus_state"] = round(ratio, 3)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    emit({
        "benchmark": "storage",
        "kv_source": "random normal float32" if args.synthetic else f"real SmolLM2 prefill of {min(args.tokens)} tokens, tiled",
        "shape": {"layers": LAYERS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "targets": {"ours_over_mlxlm": "<= 1.0 (goal 0.7), warm and dropped", "peak_rss_over_model_plus_state": "<= 1.1"},
        "results": rows,
    })


if __name__ == "__main__":
    main()
