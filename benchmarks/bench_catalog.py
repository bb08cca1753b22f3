"""The shared catalogue (issue "Many kernels, one cache directory"), JSON on stdout.

- Lookup with 10,000 catalogued checkpoints (chat-like token sequences that
  all share a 40-token template, 200-2000 tokens long, half of them
  trimmable): p50/p99 of a hit and of a miss decision (nothing longer than
  the template), change-log query included (target p99 <= 1 ms).
- Catalogue cost per committed write: the rename-and-record transaction
  plus supersession and the SSD cap check (target <= 2 ms), on real files.
- Cross-process visibility: a second store (its own SQLite connection, as
  another process has) commits; the first store's next lookup finds it.

    python benchmarks/bench_catalog.py [--files 10000] [--lookups 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import emit

import numpy as np

from mlxcache_kernel.engine.cache.catalog import FileRow
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
from mlxcache_kernel.engine.kv.tokens import token_key

IDENTITY = {"artifact": "a", "config": "c", "tokenizer": "t", "kv_scheme": "k", "runtime": "r"}


def pct(xs: list, q: float) -> float:
    return float(np.percentile(np.array(xs) * 1e3, q))


class HT:  # a host tensor over a numpy array, as the writer gets them
    def __init__(self, name, a):
        self.name, self.dtype, self.shape, self.array = name, "float32", a.shape, a

    @property
    def nbytes(self):
        return self.array.nbytes


def write_file(store: CheckpointStore, tokens: list) -> float:
    """Write a small real checkpoint file; return the seconds of catalogue work (commit + publish)."""
    a = np.zeros((1, 1, len(tokens), 4), np.float32)
    spent = []

    def commit(tmp, info):
        t0 = time.perf_counter()
        store.commit(tmp, info)
        spent.append(time.perf_counter() - t0)

    info = fmt.write_checkpoint(store.prepare_path("ns", tokens), identity=IDENTITY, namespace="ns", tokens=tokens,
                                layout=[{"kind": "KVCache", "meta": {"offset": len(tokens)}, "arrays": 2}],
                                min_reusable_offset=0, host_tensors=[HT("layers.0.0", a), HT("layers.0.1", a)],
                                trimmable=False, commit=commit)
    t0 = time.perf_counter()
    store.publish(info)
    return spent[0] + time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--writes", type=int, default=200)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    template = [int(x) for x in rng.integers(3, 50_000, 40)]
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "checkpoints"
        store = CheckpointStore(root, ssd_budget_bytes=None)
        store.register_namespace("ns", IDENTITY)
        other = CheckpointStore(root)  # another process's view, its own connection (opened before the
        other.register_namespace("ns", IDENTITY)  # rows below, which have no files its start would find)
        seqs = []
        t0 = time.perf_counter()
        with store.catalog.transaction() as db:  # rows only: lookups never open files
            for i in range(args.files):
                toks = template + [int(x) for x in rng.integers(3, 50_000, int(rng.integers(160, 1960)))]
                seqs.append(toks)
                store.catalog.add_file(db, FileRow("ns", token_key(toks), str(root / f"x{i}"), tuple(toks), 1 << 20,
                                                   1 << 20, 0, bool(i % 2), 1, time.time(), time.time(), IDENTITY))
        store.sync()
        load_s = time.perf_counter() - t0
        hits, misses = [], []
        for i in range(args.lookups):
            base = seqs[int(rng.integers(len(seqs)))]
            prompt = base + [7]  # extends a catalogued sequence: a hit of its whole length
            t = time.perf_counter()
            h = store.find(prompt, "ns")
            hits.append(time.perf_counter() - t)
            assert h is not None and h.match_len == len(base), (h, len(base))
            prompt = template + [int(x) for x in rng.integers(3, 50_000, 800)]  # shares only the template
            t = time.perf_counter()
            miss = store.find(prompt, "ns", min_len=len(template) + 8)  # only the shared template: not worth it
            assert miss is None
            misses.append(time.perf_counter() - t)
        writes = [write_file(store, template + [int(x) for x in rng.integers(3, 50_000, 300)])
                  for _ in range(args.writes)]
        other.sync()
        fresh = template + [int(x) for x in rng.integers(3, 50_000, 500)]
        write_file(other, fresh)
        t = time.perf_counter()
        seen = store.find(fresh + [1], "ns")
        visible_s = time.perf_counter() - t
        out = {
            "benchmark": "catalog",
            "catalogued_files": args.files + args.writes + 1,
            "load_rows_s": load_s,
            "hit_lookup_ms": {"p50": pct(hits, 50), "p99": pct(hits, 99)},
            "miss_lookup_ms": {"p50": pct(misses, 50), "p99": pct(misses, 99)},
            "catalogue_ms_per_committed_write": {"p50": pct(writes, 50), "p99": pct(writes, 99)},
            "cross_process": {"visible_on_next_lookup": seen is not None and seen.match_len == len(fresh),
                              "that_lookup_ms": visible_s * 1e3},
            "targets": {"lookup p99": "<= 1 ms", "catalogue per write": "<= 2 ms", "visibility": "next lookup"},
        }
        other.close()
        store.close()
    emit(out)


if __name__ == "__main__":
    main()
