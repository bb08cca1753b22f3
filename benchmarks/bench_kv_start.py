"""A delayed KV quantization (issue 32), JSON on stdout: on the default model (SmolLM2-135M float32),
for each --doc-lengths, full-precision KV against kv_bits=8 from --kv-start on (mlx-lm's --kv-bits 8
--quantized-kv-start), side by side in one run:

1. RAM and SSD bytes per token of the cached document;
2. TTFT of a second question over it (a RAM hit), median of --repeats;
3. decode tok/s of the same question with the cache off against mlx-lm's generate_step with the same
   kv_bits/quantized_kv_start on the same prompt (target >= 0.98x), interleaved --repeats times.

    python benchmarks/bench_kv_start.py [--doc-lengths 2048,8192] [--kv-start 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from common import default_model, emit, median, prompt_tokens

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlxcache_kernel.engine import Engine, SamplingParams

QUESTIONS = [f"\n\nQuestion {i}: which region had the largest variance, and in which week?" for i in range(16)]


def _question(tok, doc: str, i: int) -> list:
    return list(tok.apply_chat_template([{"role": "user", "content": doc + QUESTIONS[i]}], add_generation_prompt=True))


def _mlx_lm_decode_tps(model, prompt: list, n: int, kv_start: int | None) -> float:
    """Decode tok/s of mlx-lm alone (greedy), the first token (prefill) excluded."""
    kv = {"kv_bits": 8, "kv_group_size": 64, "quantized_kv_start": kv_start} if kv_start is not None else {}
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prefill_step_size=512, **kv)
    next(steps)
    t0, count = time.perf_counter(), 0
    for _ in steps:
        count += 1
    return count / (time.perf_counter() - t0)


def bench(model_dir, n: int, kv_start: int | None, repeats: int, decode_n: int) -> dict:
    kv = {"kv_bits": 8, "kv_start": kv_start} if kv_start is not None else {}
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=os.path.join(d, "c")) as eng:
        eng.load_model(model_dir, name="bench", **kv)
        m = eng.models.get()
        doc = m.tokenizer.decode(prompt_tokens(m.tokenizer, n))
        params = SamplingParams(max_tokens=decode_n)
        eng.generate_tokens(_question(m.tokenizer, doc, 0), params=params)
        eng.flush()
        st = eng.stats()
        doc_cp = max(eng.cache.entries(), key=lambda e: len(e.tokens)).checkpoint
        rows = []
        for i in range(1, 1 + repeats):
            q = _question(m.tokenizer, doc, i)
            hit = eng.generate_tokens(q, params=params)
            assert hit.stats["cache_source"] == "ram" and hit.stats["cached_tokens"] >= n - 1, hit.stats
            cold = eng.generate_tokens(q, params=params, use_cache=False)
            rows.append({"hit_ttft_s": hit.stats["ttft_s"], "hit_decode_tps": hit.stats["decode_tokens_per_s"],
                         "cold_decode_tps": cold.stats["decode_tokens_per_s"],
                         "mlx_lm_decode_tps": _mlx_lm_decode_tps(m.model, q, decode_n, kv_start),
                         "same_tokens": hit.tokens == cold.tokens})
        return {
            "doc_tokens": n, "kv": f"q8 from {kv_start}" if kv_start is not None else "float32",
            "min_reusable_offset": doc_cp.min_reusable_offset,
            "ram_bytes_per_token": doc_cp.kv_bytes / len(doc_cp.tokens),
            "ssd_bytes_per_token": (st.get("ssd_bytes") or 0) / len(doc_cp.tokens),  # (the one document on SSD)
            "hit_ttft_s": median([r["hit_ttft_s"] for r in rows]),
            "hit_decode_tps": median([r["hit_decode_tps"] for r in rows]),
            "cold_decode_tps": median([r["cold_decode_tps"] for r in rows]),
            "mlx_lm_decode_tps": median([r["mlx_lm_decode_tps"] for r in rows]),
            "cold_decode_over_mlx_lm": median([r["cold_decode_tps"] / r["mlx_lm_decode_tps"] for r in rows]),
            "hit_equals_cold": all(r["same_tokens"] for r in rows),
        }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-lengths", default="2048,8192")
    ap.add_argument("--kv-start", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    model_dir = default_model()
    runs = [bench(model_dir, int(n), start, args.repeats, args.decode_tokens)
            for n in args.doc_lengths.split(",") for start in (None, args.kv_start)]
    emit({"benchmark": "kv_start", "model": model_dir, "runs": runs, "loadavg": os.getloadavg(),
          "targets": {"cold_decode_over_mlx_lm": ">= 0.98"}})


if __name__ == "__main__":
    main()
