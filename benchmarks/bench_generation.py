"""Generation benchmarks (issue "Foundation"), JSON on stdout.

1. decode tokens/s of Engine.generate vs mlx_lm.stream_generate: same model,
   prompt and greedy sampler, interleaved runs. Target: ratio >= 0.98.
2. TTFT of a RAM hit vs a cold prefill at several prompt lengths. Target: a
   hit costs at most two decode steps, whatever the prefix length.
3. decode ms/token after a RAM hit vs after a cold prefill (no hidden
   full-buffer copy per step). Target: within 3%.

    python benchmarks/bench_generation.py [--lengths 512,2048,8192] [--repeats 3]

Decode speed counts (n - 1) tokens over the time from the first to the last
token for both engines (mlx-lm's own generation_tps counts n).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import default_model, emit, median, prompt_tokens

import mlx_lm

from mlxcache_kernel.engine import Engine, SamplingParams


def decode_tps(times: list[float]) -> float | None:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None


def mlx_lm_decode(model, tokenizer, prompt: list[int], n: int) -> float:
    times = []
    for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n):
        times.append(time.perf_counter())
    return decode_tps(times)


def engine_decode(eng: Engine, prompt: list[int], n: int) -> float:
    r = eng.generate_tokens(prompt, SamplingParams(max_tokens=n), use_cache=False)
    return r.stats["decode_tokens_per_s"]


def bench_decode_vs_mlx_lm(eng, m, repeats: int, n: int = 96) -> dict:
    prompt = prompt_tokens(m.tokenizer, 128)
    ours, theirs = [], []
    engine_decode(eng, prompt, 8)  # warm-up both paths
    mlx_lm_decode(m.model, m.tokenizer, prompt, 8)
    for _ in range(repeats):  # interleaved: A B A B ...
        ours.append(engine_decode(eng, prompt, n))
        theirs.append(mlx_lm_decode(m.model, m.tokenizer, prompt, n))
    return {
        "prompt_tokens": len(prompt),
        "decode_tokens": n,
        "engine_tps": ours,
        "mlx_lm_tps": theirs,
        "ratio_of_medians": median(ours) / median(theirs),
        "target": ">= 0.98",
    }


def bench_hit_vs_cold(eng, m, length: int, decode_n: int, pairs: int) -> dict:
    """`pairs` (cold prefill, RAM hit) pairs on fresh prompts; medians."""
    rows = []
    for i in range(pairs):
        prompt = prompt_tokens(m.tokenizer, length, salt=f"[{length}.{i}] ")
        params = SamplingParams(max_tokens=decode_n)
        cold = eng.generate_tokens(prompt, params)  # publishes the prompt boundary
        hit = eng.generate_tokens(prompt, params)
        assert hit.stats["cache_source"] == "ram", hit.stats
        assert hit.tokens == cold.tokens, "a hit must continue exactly like the cold run"
        rows.append((cold.stats, hit.stats))
    step_cold = median([1 / c["decode_tokens_per_s"] for c, _ in rows])
    step_hit = median([1 / h["decode_tokens_per_s"] for _, h in rows])
    hit_ttft = median([h["ttft_s"] for _, h in rows])
    return {
        "prompt_tokens": length,
        "pairs": pairs,
        "cold_ttft_s": median([c["ttft_s"] for c, _ in rows]),
        "hit_ttft_s": hit_ttft,
        "hit_ttft_in_decode_steps": hit_ttft / step_cold,
        "decode_ms_per_token_after_cold": step_cold * 1e3,
        "decode_ms_per_token_after_hit": step_hit * 1e3,
        "decode_hit_over_cold": step_hit / step_cold,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--pairs", type=int, default=3, help="cold/hit pairs per length up to 2048 tokens (longer: 1)")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d, ssd=False) as eng:
        eng.load_model(default_model(), name="bench")
        m = eng.models.get()
        out = {"model": str(m.path), "benchmark": "generation"}
        if not args.skip_decode:
            out["decode_vs_mlx_lm"] = bench_decode_vs_mlx_lm(eng, m, args.repeats)
        out["hit_vs_cold"] = [
            bench_hit_vs_cold(eng, m, int(n), args.decode_tokens, args.pairs if int(n) <= 2048 else 1)
            for n in args.lengths.split(",")
            if n
        ]
        out["targets"] = {
            "hit_ttft_in_decode_steps": "<= 2",
            "decode_hit_over_cold": "within 1.03",
        }
        emit(out)


if __name__ == "__main__":
    main()
