"""Memory the kernel really has (issue "Memory ..."), JSON on stdout. RSS sampled every 10 ms.

1. checkpoint_every=1 over 64 tokens after a 1.5k-token SmolLM2 prompt:
   decode tok/s against the same run without checkpoints (target >= 0.8x),
   peak RSS growth against one checkpoint's KV bytes (target <= 3x).
2. A 20-turn chat under a 32 MiB RAM budget: peak RSS growth against the
   budget plus the largest entry (target <= 1.1x).

    python benchmarks/bench_memory.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import default_model, emit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_memory import PeakRSS, smollm_prompt  # noqa: E402

from mlxcache_kernel.engine import Engine, SamplingParams  # noqa: E402


def checkpoint_every_token(d: str) -> dict:
    with Engine(cache_dir=d) as eng:
        eng.load_model(default_model(), name="m")
        prompt = smollm_prompt(eng.models.get().tokenizer, 1536)
        params = SamplingParams(max_tokens=64)
        eng.generate_tokens(prompt, SamplingParams(max_tokens=2))
        eng.flush()
        plain = eng.generate_tokens(prompt + [11], params)
        eng.flush()
        kv = max(e.checkpoint.kv_bytes for e in eng.cache.entries())
        with PeakRSS() as rss:
            every = eng.generate_tokens(prompt + [12], params, checkpoint_every=1)
        s = eng.stats()
    return {
        "decode_tps_plain": plain.stats["decode_tokens_per_s"],
        "decode_tps_checkpoint_every_1": every.stats["decode_tokens_per_s"],
        "decode_ratio": every.stats["decode_tokens_per_s"] / plain.stats["decode_tokens_per_s"],
        "checkpoint_kv_bytes": kv,
        "peak_rss_growth_bytes": rss.peak - rss.base,
        "peak_rss_growth_in_checkpoints": (rss.peak - rss.base) / kv,
        "intervals_written": s["inflight_queued"],
        "targets": {"decode_ratio": ">= 0.8", "peak_rss_growth_in_checkpoints": "<= 3"},
    }


def long_chat(d: str, budget: int = 32 << 20) -> dict:
    with Engine(cache_dir=d, ram_budget_bytes=budget) as eng:
        eng.load_model(default_model(), name="m")
        eng.generate("Warm up.", max_tokens=2)
        biggest = 0
        with PeakRSS() as rss:
            for turn in range(20):
                eng.generate(f"Turn {turn}: tell me one more short fact about rivers.", max_tokens=12, session="chat")
                biggest = max([biggest] + [e.nbytes for e in eng.cache.entries()])
        s = eng.stats()
    return {
        "budget_bytes": budget,
        "largest_entry_bytes": biggest,
        "peak_rss_growth_bytes": rss.peak - rss.base,
        "growth_over_budget_plus_entry": (rss.peak - rss.base) / (budget + biggest),
        "bytes_written": s["bytes_written"],
        "target": "<= 1.1",
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        emit({"benchmark": "memory", "checkpoint_every_1": checkpoint_every_token(a), "chat_20_turns": long_chat(b)})


if __name__ == "__main__":
    main()
