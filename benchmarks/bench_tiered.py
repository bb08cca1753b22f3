"""Tiered-cache benchmarks (issue "SSD tier"), JSON on stdout.

1. TTFT after a restart (SSD hit: restore + verify + one decode step) vs a
   cold prefill, at several prompt lengths.
2. decode tokens/s while background writes are in flight vs with none.
   Target: >= 0.97. Also shown: the same writes with yielding switched off,
   which is what the writer would cost if it ignored generation.

    python benchmarks/bench_tiered.py [--lengths 2048,8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile

from common import default_model, emit, median, prompt_tokens

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxcache_kernel.engine import Checkpoint, Engine


def bench_restart(model_dir: str, length: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        with Engine(cache_dir=d) as eng:
            eng.load_model(model_dir)
            prompt = prompt_tokens(eng.models.get().tokenizer, length, salt=f"<{length}> ")
            cold = eng.generate_tokens(prompt, max_tokens=8)
        with Engine(cache_dir=d, prefetch_budget_bytes=0) as eng:  # the restart: an empty RAM tier, no prefetch
            eng.load_model(model_dir)
            hit = eng.generate_tokens(prompt, max_tokens=8)
            restored = eng.stats()["ssd_restore_bytes"]
        assert hit.stats["cache_source"] == "ssd" and hit.tokens == cold.tokens, hit.stats
        return {
            "prompt_tokens": length,
            "cold_ttft_s": cold.stats["ttft_s"],
            "ssd_hit_ttft_s": hit.stats["ttft_s"],
            "ssd_lookup_and_restore_s": hit.stats["lookup_s"],
            "restored_bytes": restored,
            "speedup": cold.stats["ttft_s"] / hit.stats["ttft_s"],
        }


def synthetic_checkpoint(m, n_tokens: int, salt: int) -> Checkpoint:
    """A checkpoint shaped like the model's own KV (random values: the writer does not care)."""
    caches = make_prompt_cache(m.model)
    heads = m.config.get("num_key_value_heads", m.config["num_attention_heads"])
    dim = m.config.get("head_dim") or m.config["hidden_size"] // m.config["num_attention_heads"]
    for c in caches:
        k = mx.random.normal((1, heads, n_tokens, dim))
        c.update_and_fetch(k, k + 1)
    return Checkpoint.capture([salt] * n_tokens, caches)


def bench_decode_with_writes(model_dir: str, repeats: int, backlog: int = 6, backlog_tokens: int = 2048) -> dict:
    """Decode speed while a backlog of checkpoints is being written vs with none."""
    results = {"none": [], "writes_yielding": [], "writes_not_yielding": []}
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d) as eng:
        eng.load_model(model_dir)
        m = eng.models.get()
        cache = eng.cache
        entries = [cache.put(synthetic_checkpoint(m, backlog_tokens, 10_000 + i), m.namespace) for i in range(backlog)]
        probe = prompt_tokens(m.tokenizer, 64, salt="probe ")

        def run(mode: str) -> float:
            if mode != "none":
                cache.writer.yield_to_generation = mode == "writes_yielding"
                cache.clear(ssd=True)  # empties RAM too: put the backlog back, unwritten
                for e in entries:
                    cache.put(e.checkpoint, e.ns, evict=False)
            r = eng.generate_tokens(probe, max_tokens=32, use_cache=False)
            pending_after = cache.writer.pending()[0]
            cache.writer.wait()
            cache.poll()
            return r.stats["decode_tokens_per_s"], pending_after

        run("none")  # warm-up
        pending = {}
        for _ in range(repeats):
            for mode in results:
                tps, pending[mode] = run(mode)
                results[mode].append(tps)
        backlog_bytes = sum(e.nbytes for e in entries)
    return {
        "backlog_bytes": backlog_bytes,
        "decode_tps": results,
        "writes_still_pending_when_decode_ended": pending,
        "ratio_with_writes_yielding": median(results["writes_yielding"]) / median(results["none"]),
        "ratio_with_writes_not_yielding": median(results["writes_not_yielding"]) / median(results["none"]),
        "target": ">= 0.97 (yielding)",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model_dir = default_model()
    emit(
        {
            "benchmark": "tiered",
            "model": model_dir,
            "decode_with_background_writes": bench_decode_with_writes(model_dir, args.repeats),
            "restart_ttft": [bench_restart(model_dir, int(n)) for n in args.lengths.split(",") if n],
        }
    )


if __name__ == "__main__":
    main()
