"""A process that writes, reads or collects format-2 checkpoints in a shared cache
directory, for tests/engine/cache/ssd/test_blocks.py.

    python blocks_worker.py write ROOT SECONDS SEED [BUDGET]
    python blocks_worker.py gc ROOT SECONDS
    python blocks_worker.py kill-before-manifest ROOT N

Checkpoints are prefixes of one deterministic KV sequence (`kv_prefix`), so
processes that write overlapping prefixes share blocks, as kernels on one
machine do for a shared document. Prints one JSON line of counts.
A write or gc worker runs for SECONDS and until it did enough (WRITES and
RESTORES, GC_RUNS): counts, not time, however busy the machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.cache.ssd.persist import persist
from mlxcache_kernel.engine.cache.ssd.restore import restore
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore, CheckpointUnavailable
from mlxcache_kernel.engine.cache.ssd.writer import WriteJob
from mlxcache_kernel.engine.kv.checkpoint import Checkpoint

IDENTITY = {"artifact": "blocks-test"}
NS = "ns"
MAX_TOKENS = 400
WRITES, RESTORES, GC_RUNS = 10, 3, 6  # at least, per worker
_BASE = np.random.default_rng(7).standard_normal((2, 1, 2, MAX_TOKENS, 8)).astype(np.float32)
TOKENS = tuple(int(t) for t in np.random.default_rng(8).integers(3, 1000, MAX_TOKENS))


def kv_prefix(n: int, layers: int = 2) -> Checkpoint:
    """The state of the first n tokens: the same bytes in every process."""
    caches = []
    for i in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.array(_BASE[0, :, :, :n] + i), mx.array(_BASE[1, :, :, :n] - i))
        caches.append(c)
    return Checkpoint.capture(TOKENS[:n], caches)


def expected(n: int) -> list[np.ndarray]:
    return [np.array(a) for a in kv_prefix(n).arrays()]


def open_store(root: str, budget: int | None = None) -> CheckpointStore:
    s = CheckpointStore(Path(root), ssd_budget_bytes=budget)
    s.register_namespace(NS, IDENTITY)
    return s


def write_one(store: CheckpointStore, n: int):
    done = persist(store, WriteJob.from_checkpoint(kv_prefix(n), NS, IDENTITY))
    store.publish(done.info)
    return done


def main() -> None:
    mode, root = sys.argv[1], sys.argv[2]
    if mode == "kill-before-manifest":
        store = open_store(root)

        def die(*a, **k):  # every block is durable; the manifest never comes
            os.kill(os.getpid(), signal.SIGKILL)

        fmt.write_checkpoint = die
        write_one(store, int(sys.argv[3]))
        return
    seconds = float(sys.argv[3])
    deadline = time.monotonic() + seconds
    if mode == "gc":
        store, runs, removed = open_store(root), 0, 0
        while time.monotonic() < deadline or runs < GC_RUNS:
            removed += len(store.gc()["blocks_removed"])
            runs += 1
        print(json.dumps({"gc_runs": runs, "blocks_removed": removed}))
        return
    rng = random.Random(int(sys.argv[4]))
    store = open_store(root, int(sys.argv[5]) if len(sys.argv) > 5 else None)
    counts = {"writes": 0, "restores": 0, "misses": 0, "block_missing": 0, "wrong": 0}
    while time.monotonic() < deadline or counts["writes"] < WRITES or counts["restores"] < RESTORES:
        n = rng.randrange(1, MAX_TOKENS + 1)
        if rng.random() < 0.6:
            write_one(store, n)
            counts["writes"] += 1
            continue
        hit = store.find(list(TOKENS[:n]) + [-1], NS)
        if hit is None:
            continue
        try:
            cp = restore(store, hit)
        except CheckpointUnavailable as exc:  # the manifest went first (cap, supersession): a miss
            counts["misses"] += 1
            if "is missing" in str(exc) or "BLAKE3" in str(exc):  # never while leased
                counts["block_missing"] += 1
                counts.setdefault("errors", []).append(str(exc))
            continue
        counts["restores"] += 1
        want = expected(len(hit))
        if not all(np.array_equal(np.array(a), b) for a, b in zip(cp.arrays(), want)):
            counts["wrong"] += 1
    counts["unleased_reads"] = store.stats()["unleased_reads"]
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
