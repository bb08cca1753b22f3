"""RAM holds KV, not growth padding: ram_used_bytes / ram_kv_bytes, JSON on stdout.

    .venv/bin/python benchmarks/bench_ram.py [--doc-tokens 2048] [--branches 8]

SmolLM2, the real engine, RAM only, a fresh engine per case:
- 12 short prompts (about 48 tokens each, 16 new tokens each);
- a 20-turn chat session (12 new tokens a turn);
- `--branches` questions over one `--doc-tokens` document (each a chat turn
  of its own asking about it): ram_kv_bytes counts the document once (the
  longest use of every shared buffer), so sharing shows as a ratio near 1
  and copying the document per branch as a ratio far above it.
Target: ram_used_bytes / ram_kv_bytes <= 1.25 after each. The per-case
`kv_bytes_if_unshared` is what the entries' KV adds up to when every branch
holds its own copy of the document.
"""

from __future__ import annotations

import argparse
import tempfile

from common import default_model, emit, prompt_tokens

from mlxcache_kernel.engine import Engine


def _report(eng: Engine, **extra) -> dict:
    s = eng.stats()
    entries = eng.cache.entries()
    return {
        "ram_entries": s["ram_entries"],
        "ram_used_bytes": s["ram_used_bytes"],
        "ram_kv_bytes": s["ram_kv_bytes"],
        "used_over_kv": round(s["ram_used_bytes"] / s["ram_kv_bytes"], 3),
        "kv_bytes_if_unshared": sum(e.checkpoint.kv_bytes for e in entries),
        **extra,
    }


def short_prompts(path: str) -> dict:
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d, ssd=False) as eng:
        eng.load_model(path)
        tok = eng.models.get().tokenizer
        for i in range(12):
            eng.generate_tokens(prompt_tokens(tok, 48, salt=f"[{i}] "), max_tokens=16)
        return _report(eng)


def chat(path: str) -> dict:
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d, ssd=False) as eng:
        eng.load_model(path)
        for turn in range(20):
            eng.generate(f"Turn {turn}: tell me one more short fact about rivers.", max_tokens=12, session="chat")
        return _report(eng)


def branches(path: str, doc_tokens: int, n: int) -> dict:
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d, ssd=False) as eng:
        eng.load_model(path)
        tok = eng.models.get().tokenizer
        doc = tok.decode(prompt_tokens(tok, doc_tokens))
        ttft = []
        for i in range(n):
            ids = tok.apply_chat_template([{"role": "user", "content": f"{doc}\n\nQuestion {i}: what stands out in "
                                            f"paragraph {i * 3}?"}], add_generation_prompt=True)
            ttft.append(eng.generate_tokens(list(ids), max_tokens=12).stats["ttft_s"])
        return _report(eng, doc_tokens=doc_tokens, ttft_s=ttft)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--branches", type=int, default=8)
    args = ap.parse_args()
    path = default_model()
    emit({
        "benchmark": "ram",
        "model": path,
        "short_prompts": short_prompts(path),
        "chat_20_turns": chat(path),
        "branches_of_one_document": branches(path, args.doc_tokens, args.branches),
        "loadavg": open("/proc/loadavg").read().split()[:3],
        "target": "used_over_kv <= 1.25",
    })


if __name__ == "__main__":
    main()
