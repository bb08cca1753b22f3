"""KV quantization on the default model (issue "Every cache kind exact"), JSON on stdout.

SmolLM2-135M with float32, q8 and q4 KV (group size 64, quantized from the
first token):
- RAM bytes per cached token against float32, scales and biases included
  (targets: q8 <= 0.30, q4 <= 0.17);
- greedy agreement with float KV over 20 prompts: identical continuations,
  and the share of positions before the first divergence;
- decode tokens/s against float KV (medians).

    python benchmarks/bench_kv_quant.py [--prompts 20] [--tokens 32]
"""

from __future__ import annotations

import argparse
import tempfile

from common import default_model, emit, median, prompt_tokens

from mlxcache_kernel.engine import Engine, SamplingParams

SCHEMES = {"float32": None, "q8": 8, "q4": 4}
TOPICS = ["a harbour town", "photosynthesis", "the printing press", "a chess opening", "tide tables",
          "bread baking", "the water cycle", "a violin", "glaciers", "binary numbers"]


def first_divergence(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=args.tokens)
    out = {"benchmark": "kv_quant", "model": default_model(), "schemes": {}}
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d, ssd=False) as eng:
        for name, bits in SCHEMES.items():
            eng.load_model(default_model(), name=name, kv_bits=bits)
        tok = eng.models.get("float32").tokenizer
        prompts = []
        for i in range(args.prompts):
            text = f"Write two sentences about {TOPICS[i % len(TOPICS)]} (variant {i})."
            prompts.append(eng.encode_prompt(text, model="float32"))
        runs = {name: [] for name in SCHEMES}
        for p in prompts:  # interleaved, so machine noise spreads over every scheme
            for name in SCHEMES:
                r = eng.generate_tokens(p, params=params, model=name, use_cache=False)
                runs[name].append(r)
        long_prompt = prompt_tokens(tok, 1024)
        for name in SCHEMES:
            r = eng.generate_tokens(long_prompt, max_tokens=2, model=name)
            entry = max(eng.cache.entries(eng.models.get(name).namespace), key=lambda e: len(e.tokens))
            out["schemes"][name] = {
                "kv_scheme": eng.models.info(name)["kv_scheme"],
                "ram_bytes_per_token": entry.nbytes / len(entry.tokens),
                "kv_bytes_per_token": entry.checkpoint.kv_bytes / len(entry.tokens),
                "decode_tokens_per_s": median([x.stats["decode_tokens_per_s"] for x in runs[name]]),
            }
    base = out["schemes"]["float32"]
    for name in ("q8", "q4"):
        s = out["schemes"][name]
        pairs = list(zip(runs["float32"], runs[name]))
        s["kv_bytes_vs_float32"] = s["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        s["ram_bytes_vs_float32"] = s["ram_bytes_per_token"] / base["ram_bytes_per_token"]
        s["identical_continuations"] = sum(a.tokens == b.tokens for a, b in pairs)
        s["agreeing_prefix_share"] = sum(first_divergence(a.tokens, b.tokens) for a, b in pairs) / sum(
            len(a.tokens) for a, _ in pairs)
        s["decode_vs_float32"] = s["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    out["prompts"], out["decode_tokens"] = len(prompts), args.tokens
    out["targets"] = {"q8 ram_bytes_vs_float32": "<= 0.30", "q4 ram_bytes_vs_float32": "<= 0.17"}
    emit(out)


if __name__ == "__main__":
    main()
