"""Many continuations over one cached document (issues 22 and 29), JSON on stdout.

N different questions over one ~2k-token document that is already cached (a
question asked before), 48 new tokens each, greedy, on the default model.
Contenders, each in a fresh engine:

- `Engine.generate_batch`: rows attend to the shared document once (cascade
  attention over the lent prefix, each row's own tail apart; `batch_mode`
  "shared-prefix");
- a serial loop of `Engine.generate_tokens`, cache on (each question takes the
  document from RAM);
- mlx-lm's `batch_generate` without a cache (every row prefills the document),
  from an empty engine.

Beside the wall time: the median first-token time and the rows' decode speed
(tokens per second per row), and MLX's peak memory against the target's bound
`model + document KV + 1.5 x the rows' tails` (a tail: the row's question and
its new tokens). Greedy agreement with the serial loop is reported as it is.

    python benchmarks/bench_batch.py [--rows 8,32] [--doc-tokens 2000] [--max-tokens 48] [--skip-mlx-lm]
                                     [--kv-bits 8 --kv-start 1024]

Targets at 8 rows: >= 4x the serial loop, >= 5x mlx-lm batch_generate;
at 32 rows: peak <= model + document KV + 1.5 x tails.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import default_model, emit, prompt_tokens

import mlx.core as mx

from mlxcache_kernel.engine import Engine, SamplingParams


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def prompts_for(eng: Engine, doc: str, n: int) -> list[list[int]]:
    questions = [f"Question {i}: what variance did the committee note for item {i * 7 + 3}, and in which region?"
                 for i in range(n)]
    return [eng.encode_prompt(f"Read this report.\n\n{doc}\n\n{q}") for q in questions]


def timed(fn):
    mx.reset_peak_memory()
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t, int(mx.get_peak_memory())


KV: dict = {}  # --kv-bits/--kv-start: the model's KV quantized (rows then convert at kv_start)


def fresh_engine(model: str, d: str) -> Engine:
    eng = Engine(cache_dir=d, prefetch_budget_bytes=0)
    eng.load_model(model, name="bench", **KV)
    return eng


def row_stats(rs: list) -> dict:
    return {"median_ttft_s": statistics.median(r.stats["ttft_s"] for r in rs),
            "median_row_decode_tok_s": statistics.median(r.stats["decode_tokens_per_s"] or 0 for r in rs),
            "decode_tokens": sum(len(r.tokens) for r in rs),
            "cached_tokens": sum(r.stats["cached_tokens"] for r in rs),
            "modes": sorted({r.stats.get("batch_mode", "single") for r in rs})}


def run_rows(model: str, doc: str, n: int, max_tokens: int, mlx_lm_baseline: bool) -> dict:
    out = {"rows": n, "load_before": loadavg()}
    tokens = {}
    for name in ("generate_batch", "serial_generate"):
        with tempfile.TemporaryDirectory() as d, fresh_engine(model, d) as eng:
            prompts = prompts_for(eng, doc, n)
            eng.generate(f"Read this report.\n\n{doc}\n\nSummarize it.", max_tokens=1)  # the document cached
            doc_entry = eng.cache.entries()[0]
            per_token = doc_entry.checkpoint.kv_bytes / len(doc_entry.tokens)
            mx.synchronize()
            resident = int(mx.get_active_memory())  # the model and the cached document
            if name == "generate_batch":
                rs, wall, peak = timed(lambda: eng.generate_batch(prompts, max_tokens=max_tokens))
            else:
                params = SamplingParams(max_tokens=max_tokens)
                rs, wall, peak = timed(lambda: [eng.generate_tokens(p, params=params) for p in prompts])
            tokens[name] = [r.tokens for r in rs]
            shared = min(r.stats["cached_tokens"] for r in rs)
            tails = int(per_token * sum(len(p) - shared + max_tokens for p in prompts))
            out[name] = {"wall_s": wall, "peak_memory_bytes": peak, "resident_before_bytes": resident,
                         "document_kv_bytes": doc_entry.checkpoint.kv_bytes, "rows_tails_bytes": tails,
                         "peak_within_bound": peak <= resident + 1.5 * tails,
                         "peak_over_resident_per_tail_byte": (peak - resident) / tails, **row_stats(rs)}
            eng.flush()
    if mlx_lm_baseline:
        import mlx_lm

        with tempfile.TemporaryDirectory() as d, fresh_engine(model, d) as eng:
            m, prompts = eng.models.get(), prompts_for(eng, doc, n)
            _, wall, peak = timed(lambda: mlx_lm.batch_generate(m.model, m.tokenizer, prompts, max_tokens=max_tokens,
                                                                return_token_ids=True))
            out["mlx_lm_batch_generate_no_cache"] = {"wall_s": wall, "peak_memory_bytes": peak}
        out["speedup_vs_mlx_lm_batch_generate"] = wall / out["generate_batch"]["wall_s"]
    out["speedup_vs_serial_generate"] = out["serial_generate"]["wall_s"] / out["generate_batch"]["wall_s"]
    same = [a == b for a, b in zip(tokens["generate_batch"], tokens["serial_generate"])]
    out["greedy_rows_identical_to_serial"] = f"{sum(same)}/{n}"
    out["load_after"] = loadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,32")
    ap.add_argument("--doc-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--skip-mlx-lm", action="store_true", help="skip mlx-lm's batch_generate (the slow baseline)")
    ap.add_argument("--kv-bits", type=int, help="quantized KV (mlx-lm's batch_generate has none: skipped)")
    ap.add_argument("--kv-start", type=int, help="with --kv-bits: full precision before this token")
    args = ap.parse_args()
    if args.kv_bits:
        KV.update(kv_bits=args.kv_bits, kv_start=args.kv_start)
        args.skip_mlx_lm = True
    model = default_model()
    with tempfile.TemporaryDirectory() as d, fresh_engine(model, d) as eng:
        tok = eng.models.get().tokenizer
        doc = tok.decode(prompt_tokens(tok, args.doc_tokens))
    rows = [int(n) for n in args.rows.split(",")]
    out = {"benchmark": "batch", "model": model, "doc_tokens": args.doc_tokens, "max_tokens": args.max_tokens, "kv": KV,
           "runs": [run_rows(model, doc, n, args.max_tokens, mlx_lm_baseline=not args.skip_mlx_lm and n == rows[0])
                    for n in rows]}
    out["targets"] = {"rows 8": {"speedup_vs_serial_generate": ">= 4", "speedup_vs_mlx_lm_batch_generate": ">= 5"},
                      "rows 32": "peak_within_bound (peak <= model + document KV + 1.5 x the rows' tails)"}
    emit(out)


if __name__ == "__main__":
    main()
