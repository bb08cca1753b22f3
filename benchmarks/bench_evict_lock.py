"""The SSD cap under a big eviction (issue 27): one publish over a directory of 10,000
catalogued checkpoints (real manifests and blocks) whose budget leaves room for the new file
alone, so the cap evicts all of them. The cap goes in short transactions of EVICT_CHUNK files
(engine/cache/ssd/capacity.py), like remove(); before, it evicted inside the one publish transaction
(5,000 evictions held the write lock 0.72 s). JSON on stdout: the write-lock hold of each
transaction of that publish (p50/p99/max), how many, the files evicted and the seconds.
Target: p99 <= 50 ms per transaction.

    python benchmarks/bench_evict_lock.py [--files 10000] [--per-file 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench_catalog import big_directory, span_job, summary
from common import emit

import numpy as np

from mlxcache_kernel.engine.cache.ssd.capacity import EVICT_CHUNK
from mlxcache_kernel.engine.cache.ssd.persist import persist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--per-file", type=int, default=1, help="blocks per checkpoint")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "checkpoints"
        t0 = time.perf_counter()
        store = big_directory(root, args.files, args.per_file, rng)
        setup_s = time.perf_counter() - t0
        job = span_job([int(x) for x in rng.integers(3, 50_000, 320)], 7)
        persisted = persist(store, job)  # written and committed; its publish applies the cap
        store.ssd_budget_bytes = persisted.info.file_bytes + sum(h.nbytes for h in job.host_tensors) + 4096
        holds = store.catalog.holds = []
        t = time.perf_counter()
        store.publish(persisted.info)
        publish_s = time.perf_counter() - t
        holds = list(holds)  # (not the close's)
        stats = store.stats()
        store.close()
    emit({"benchmark": "evict_lock", "files_before": args.files, "blocks_per_file": args.per_file,
          "setup_s": round(setup_s, 1), "evict_chunk": EVICT_CHUNK, "files_after": stats["files"],
          "publish_seconds": round(publish_s, 3), "transactions": len(holds),
          "transactions_by_label": {k: sum(1 for label, _ in holds if label == k) for k in sorted({h[0] for h in holds})},
          "write_lock_hold_per_transaction": summary([s for _, s in holds]),
          "target": "p99 <= 50 ms per transaction"})


if __name__ == "__main__":
    main()
