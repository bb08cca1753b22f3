"""Speculative decoding over the cache (issue 31), JSON on stdout. On the default model (SmolLM2-135M
float32) with a layer-skip draft built from its own weights: its first --draft-layers layers, its own
final norm and (tied) head, the same tokenizer files (so real, partial acceptance).

1. For each K in --ks: greedy decode tok/s of the engine with the draft against the engine without it,
   and mlx-lm's `stream_generate(..., draft_model=...)` against mlx-lm's plain `stream_generate` on the
   same pair, same prompt, same tokens, interleaved --repeats times. Acceptance: the engine's accepted
   / proposed draft tokens, and for both the share of emitted tokens that came from the draft
   (mlx-lm's `from_draft`). Target: the engine's speedup >= mlx-lm's.
2. TTFT of a rerun and of a second question over a cached --doc-tokens document, with the draft and
   without (the draft's state comes from the cache too). Target: with / without <= 1.1.

    python benchmarks/bench_speculative.py [--ks 2,3,4,5,6] [--draft-layers 8] [--decode-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from common import default_model, emit, median, prompt_tokens

import mlx.core as mx
from mlx_lm import load as lm_load
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from mlxcache_kernel.engine import Engine, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. Tell it in detail."
QUESTIONS = ["\n\nQuestion: which region had the largest variance?", "\n\nQuestion: what was asked for week 7?"]


def layer_skip_draft(src: Path, dst: Path, n_layers: int) -> Path:
    """A draft of `src`'s first n layers with its own norm and head; everything else copied as is."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= n_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--draft-layers must be from 1 to {config['num_hidden_layers'] - 1}")
    config["num_hidden_layers"] = n_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    weights = mx.load(str(src / "model.safetensors"))
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n_layers}
    mx.save_safetensors(str(dst / "model.safetensors"), keep)
    return dst


def _lm_run(model, tok, prompt: list, n: int, draft=None, k: int = 0) -> dict:
    kw = dict(draft_model=draft, num_draft_tokens=k) if draft is not None else {}
    tokens, from_draft, last = [], 0, None
    for r in stream_generate(model, tok, prompt, max_tokens=n, sampler=make_sampler(0.0), **kw):
        tokens.append(r.token)
        from_draft += bool(getattr(r, "from_draft", False))
        last = r
    return {"tokens": tokens, "tps": last.generation_tps, "from_draft": from_draft}


def bench_decode(eng, target_dir, draft_dir, ks, repeats: int, n: int) -> list:
    m = eng.models.get("target")
    prompt = list(m.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    params = SamplingParams(max_tokens=n)
    lm_t, lm_tok = lm_load(str(target_dir))
    lm_d, _ = lm_load(str(draft_dir))
    rows = []
    for k in ks:
        runs = []
        for _ in range(repeats):  # interleaved under the same load; use_cache=False: decode speed only
            plain = eng.generate_tokens(prompt, params=params, model="target", use_cache=False)
            spec = eng.generate_tokens(prompt, params=params, model="target", use_cache=False, draft="draft",
                                       num_draft_tokens=k)
            lm_plain = _lm_run(lm_t, lm_tok, prompt, n)
            lm_spec = _lm_run(lm_t, lm_tok, prompt, n, lm_d, k)
            assert spec.tokens == plain.tokens, "speculative decoding changed the tokens"
            runs.append((plain, spec, lm_plain, lm_spec))
        plain, spec, lm_plain, lm_spec = runs[-1]
        s = spec.stats
        ours = median([b.stats["decode_tokens_per_s"] / a.stats["decode_tokens_per_s"] for a, b, _, _ in runs])
        theirs = median([d["tps"] / c["tps"] for _, _, c, d in runs])
        rows.append({
            "k": k,
            "tokens": len(spec.tokens),
            "same_tokens_as_mlx_lm": lm_spec["tokens"] == spec.tokens and lm_plain["tokens"] == plain.tokens,
            "draft_tokens_proposed": s["draft_tokens_proposed"], "draft_tokens_accepted": s["draft_tokens_accepted"],
            "acceptance": s["draft_acceptance"],
            "from_draft_share": round(s["draft_tokens_accepted"] / len(spec.tokens), 4),
            "mlx_lm_from_draft_share": round(lm_spec["from_draft"] / len(lm_spec["tokens"]), 4),
            "engine_plain_tps": median([a.stats["decode_tokens_per_s"] for a, _, _, _ in runs]),
            "engine_draft_tps": median([b.stats["decode_tokens_per_s"] for _, b, _, _ in runs]),
            "mlx_lm_plain_tps": median([c["tps"] for _, _, c, _ in runs]),
            "mlx_lm_draft_tps": median([d["tps"] for _, _, _, d in runs]),
            "engine_speedup": ours, "mlx_lm_speedup": theirs,
            "speedup_vs_mlx_lm": ours / theirs if theirs else None,
        })
    return rows


def bench_ttft(eng, doc_n: int, repeats: int) -> dict:
    """TTFT of a rerun and of another question over the cached document, with the draft and without."""
    m = eng.models.get("target")
    doc = m.tokenizer.decode(prompt_tokens(m.tokenizer, doc_n))
    params = SamplingParams(max_tokens=8)

    def ask(i: int) -> list:
        return list(m.tokenizer.apply_chat_template([{"role": "user", "content": doc + QUESTIONS[i]}],
                                                    add_generation_prompt=True))

    out = {}
    for label, kw in (("plain", {}), ("draft", dict(draft="draft", num_draft_tokens=4))):
        rerun, second = [], []
        for _ in range(repeats):
            eng.flush(timeout=60)  # no write of the previous round lands after the clear
            eng.cache_clear(ssd=True)
            first = eng.generate_tokens(ask(0), params=params, model="target", **kw)
            again = eng.generate_tokens(ask(0), params=params, model="target", **kw)
            other = eng.generate_tokens(ask(1), params=params, model="target", **kw)
            assert again.stats["cached_tokens"] == len(again.prompt_tokens) - 1, again.stats
            assert other.stats["cached_tokens"] >= doc_n - 1, other.stats
            if kw:
                assert again.stats["draft_prefilled_tokens"] == 0, again.stats
                assert other.stats["draft_cached_tokens"] >= doc_n - 1, other.stats
            rerun.append(again.stats["ttft_s"])
            second.append(other.stats["ttft_s"])
        out[label] = {"cold_ttft_s": first.stats["ttft_s"], "rerun_ttft_s": median(rerun),
                      "second_question_ttft_s": median(second), "second_question_new_tokens":
                      len(other.prompt_tokens) - other.stats["cached_tokens"],
                      "draft_prefilled_tokens_second": other.stats.get("draft_prefilled_tokens")}
    for kind in ("rerun", "second_question"):
        out[f"{kind}_draft_over_plain"] = out["draft"][f"{kind}_ttft_s"] / out["plain"][f"{kind}_ttft_s"]
    out["doc_tokens"] = doc_n
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ks", default="2,3,4,5,6")
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--skip-ttft", action="store_true")
    args = ap.parse_args()
    target = Path(default_model())
    ks = [int(x) for x in args.ks.split(",") if x]
    with tempfile.TemporaryDirectory() as d:
        draft = layer_skip_draft(target, Path(d) / "draft", args.draft_layers)
        with Engine(cache_dir=Path(d) / "cache", prefetch_budget_bytes=0) as eng:
            eng.load_model(target, name="target")
            eng.load_model(draft, name="draft")
            out = {"benchmark": "speculative", "model": str(target), "draft_layers": args.draft_layers,
                   "decode": bench_decode(eng, target, draft, ks, args.repeats, args.decode_tokens)}
            if not args.skip_ttft:
                out["ttft"] = bench_ttft(eng, args.doc_tokens, args.repeats)
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    out["targets"] = {"decode[].engine_speedup": ">= mlx_lm_speedup",
                      "ttft.rerun_draft_over_plain": "<= 1.1", "ttft.second_question_draft_over_plain": "<= 1.1"}
    emit(out)


if __name__ == "__main__":
    main()
