"""Batches over one document (issue 22), JSON on stdout.

N different questions over one ~2k-token document, 48 new tokens each, greedy,
on the default model; wall time of, each from an empty cache:

- `Engine.generate_batch` (the document prefilled once, rows decode together);
- a serial loop of `Engine.generate_tokens`, cache on (the first question
  prefills the document, the others take it from RAM);
- mlx-lm's `batch_generate`, no cache (every row prefills the document).

Then the same two engine contenders with the document already cached (a
question asked before), and what the rows copy: mlx-lm merges every row's KV
into its left-padded batch caches (`merge_copy_bytes`), after each row's own caches held
`row_own_cache_bytes` (all rows, as they join); `peak_memory_bytes` is
MLX's peak during each contender. Greedy agreement of the batch with the serial
loop is reported as it is (batch numerics differ from B = 1).

    python benchmarks/bench_batch.py [--rows 8,32] [--doc-tokens 2000] [--max-tokens 48]

Targets at 8 rows: generate_batch >= 2x the serial loop, >= 5x mlx-lm batch_generate.
"""

from __future__ import annotations

import argparse
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
    if hasattr(mx, "reset_peak_memory"):
        mx.reset_peak_memory()
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t, int(mx.get_peak_memory()) if hasattr(mx, "get_peak_memory") else None


def fresh_engine(model: str, d: str) -> Engine:
    eng = Engine(cache_dir=d, prefetch_budget_bytes=0)
    eng.load_model(model, name="bench")
    return eng


class RowBytes:
    """What each row's own caches hold when it joins the batch (instrumenting `BatchRun._prepare`):
    a row whose first append copied the shared document holds it again; views of it hold nothing."""

    def __init__(self):
        from mlxcache_kernel.engine.batch import BatchRun

        self.rows: list[int] = []
        real = BatchRun._prepare

        def prepare(run, row):
            caches = real(run, row)
            self.rows.append(sum(int(c.nbytes) for c in caches))
            return caches

        BatchRun._prepare = prepare


ROW_BYTES = None


def run_rows(model: str, doc: str, n: int, max_tokens: int, warm_doc: bool, mlx_lm_baseline: bool = True) -> dict:
    params = SamplingParams(max_tokens=max_tokens)
    out = {"rows": n, "doc_cached_before": warm_doc, "load_before": loadavg()}
    tokens = {}
    for name in ("generate_batch", "serial_generate"):
        with tempfile.TemporaryDirectory() as d, fresh_engine(model, d) as eng:
            prompts = prompts_for(eng, doc, n)
            if warm_doc:  # a question asked before: the document's prefix is in RAM
                eng.generate(f"Read this report.\n\n{doc}\n\nSummarize it.", max_tokens=1)
            prefilled0 = eng.stats()["engine_prefilled_tokens"]
            if name == "generate_batch":
                ROW_BYTES.rows.clear()
                rs, wall, peak = timed(lambda: eng.generate_batch(prompts, max_tokens=max_tokens))
            else:
                rs, wall, peak = timed(lambda: [eng.generate_tokens(p, params) for p in prompts])
            tokens[name] = [r.tokens for r in rs]
            entry = eng.cache.entries()[0]
            per_token = entry.checkpoint.kv_bytes / len(entry.tokens)
            out[name] = {"wall_s": wall, "peak_memory_bytes": peak, "prompt_tokens": len(prompts[0]),
                         "cached_tokens": sum(r.stats["cached_tokens"] for r in rs),
                         "prefilled_tokens": eng.stats()["engine_prefilled_tokens"] - prefilled0,
                         "median_ttft_s": sorted(r.stats["ttft_s"] for r in rs)[n // 2],
                         "decode_tokens": sum(len(r.tokens) for r in rs)}
            if name == "generate_batch":
                width = max(len(p) for p in prompts) + max_tokens  # mlx-lm's batch buffer: every row left padded
                out[name]["merge_copy_bytes"] = int(per_token * sum(len(p) for p in prompts))
                out[name]["batch_cache_bytes"] = int(per_token * width * n)
                out[name]["kv_bytes_per_token"] = per_token
                out[name]["row_own_cache_bytes"] = sum(ROW_BYTES.rows)  # before the merge, all rows
            eng.flush()
    if not warm_doc and mlx_lm_baseline:
        import mlx_lm

        with tempfile.TemporaryDirectory() as d, fresh_engine(model, d) as eng:
            m, prompts = eng.models.get(), prompts_for(eng, doc, n)
            resp, wall, peak = timed(lambda: mlx_lm.batch_generate(m.model, m.tokenizer, prompts,
                                                                   max_tokens=max_tokens, return_token_ids=True))
            out["mlx_lm_batch_generate"] = {"wall_s": wall, "peak_memory_bytes": peak}
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
    ap.add_argument("--skip-warm", action="store_true", help="skip the runs with the document cached beforehand")
    ap.add_argument("--skip-mlx-lm", action="store_true", help="skip mlx-lm's batch_generate (the slow baseline)")
    args = ap.parse_args()
    global ROW_BYTES
    ROW_BYTES = RowBytes()
    model = default_model()
    with tempfile.TemporaryDirectory() as d, fresh_engine(model, d) as eng:
        tok = eng.models.get().tokenizer
        doc = tok.decode(prompt_tokens(tok, args.doc_tokens))
    out = {"benchmark": "batch", "model": model, "doc_tokens": args.doc_tokens, "max_tokens": args.max_tokens,
           "cold": [run_rows(model, doc, int(n), args.max_tokens, warm_doc=False, mlx_lm_baseline=not args.skip_mlx_lm)
                    for n in args.rows.split(",")]}
    if not args.skip_warm:
        out["doc_cached"] = [run_rows(model, doc, int(args.rows.split(",")[0]), args.max_tokens, warm_doc=True)]
    out["targets"] = {"rows": 8, "speedup_vs_serial_generate": ">= 2", "speedup_vs_mlx_lm_batch_generate": ">= 5"}
    emit(out)


if __name__ == "__main__":
    main()
