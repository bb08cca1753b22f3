"""A cold prefill over 8-bit KV (kv_bits=8 from --kv-start on), JSON on stdout: mlx-lm's quantized
attention for every forward against the engine's default (forwards of 64 or more tokens attend over
the KV dequantized, kv/quantize_start.py), interleaved --repeats times in one process on the default
model; TTFT, decode tok/s, and whether both give the same tokens.

    python benchmarks/bench_kv_prefill.py [--tokens 2048] [--kv-start 1024] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from common import default_model, emit, median, prompt_tokens

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.kv import quantize_start

MODES = {"quantized_attention": 10**9, "dequantized_long_forwards": quantize_start.MIN_DEQUANTIZED_QUERIES}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--kv-start", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=16)
    args = ap.parse_args()
    runs = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=os.path.join(d, "c"), ssd=False) as eng:
        eng.load_model(default_model(), name="bench", kv_bits=8, kv_start=args.kv_start)
        prompt = prompt_tokens(eng.models.get().tokenizer, args.tokens)
        for _ in range(args.repeats):
            for mode, threshold in MODES.items():
                quantize_start.MIN_DEQUANTIZED_QUERIES = threshold
                r = eng.generate_tokens(prompt, max_tokens=args.decode_tokens, use_cache=False)
                runs[mode].append({"ttft_s": r.stats["ttft_s"], "decode_tps": r.stats["decode_tokens_per_s"],
                                   "tokens": r.tokens, "loadavg": os.getloadavg()[0]})
    emit({"benchmark": "kv_prefill", "prompt_tokens": args.tokens, "kv_start": args.kv_start,
          "modes": {m: {"ttft_s": median([r["ttft_s"] for r in rs]), "decode_tps": median([r["decode_tps"] for r in rs]),
                        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]} for m, rs in runs.items()},
          "same_tokens": len({tuple(r["tokens"]) for rs in runs.values() for r in rs}) == 1})


if __name__ == "__main__":
    main()
