"""Scoring continuations over one cached context (issue 29), JSON on stdout.

16 continuations of ~10 tokens over a ~2k-token context that is already cached
(scored once before), on the default model:

- `Engine.score`: the context from RAM, every continuation in one batch over it
  (cascade attention over the shared prefix);
- the floor: one forward of all continuation tokens together over a copy of the
  context's KV (what the continuations cost with no per-continuation overhead);
- lm-eval-style scoring with mlx-lm: one full forward per continuation (context
  and continuation), as `loglikelihood` does without a cache;
- `Engine.score` with the cache off (the context prefilled once, then the batch).

Agreement of the scores with mlx-lm's full forwards is reported (max |difference|
per token). Target: `Engine.score` on the cached context <= 2x the floor.

With --kv-bits (and --kv-start) the model's KV is quantized (mlx-lm's forwards have no
kv_bits: --skip-mlx-lm); the continuations are also scored one after another (the
serial path, as a model the rows cache cannot route takes it), and the scores of the
two paths are compared.

    python benchmarks/bench_scoring.py [--context-tokens 2000] [--options 16] [--repeat 3]
                                       [--kv-bits 8 --kv-start 1024] [--skip-mlx-lm]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from contextlib import contextmanager

from common import default_model, emit, prompt_tokens

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.generate import scoring


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def best(fn, repeat: int) -> tuple:
    walls, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t)
    return out, min(walls), statistics.median(walls)


@contextmanager
def _unrouted(model, attend=None):
    yield False  # no module routed through the rows cache: the engine scores one by one


def serial(eng, ctx, conts):
    """Engine.score the serial way (the path quantized KV took before it batched)."""
    routing, scoring.routing = scoring.routing, _unrouted
    try:
        return eng.score(ctx, conts)
    finally:
        scoring.routing = routing


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context-tokens", type=int, default=2000)
    ap.add_argument("--options", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kv-bits", type=int, help="quantized KV (then also the serial path, and no mlx-lm forwards)")
    ap.add_argument("--kv-start", type=int, help="with --kv-bits: full precision before this token")
    ap.add_argument("--skip-mlx-lm", action="store_true", help="skip the full forward per continuation (slow)")
    args = ap.parse_args()
    kv = dict(kv_bits=args.kv_bits, kv_start=args.kv_start) if args.kv_bits else {}
    model_path = default_model()
    out = {"benchmark": "scoring", "model": model_path, "context_tokens": args.context_tokens,
           "options": args.options, **kv, "load_before": loadavg()}
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d, prefetch_budget_bytes=0) as eng:
        eng.load_model(model_path, name="bench", **kv)
        m = eng.models.get()
        ctx = prompt_tokens(m.tokenizer, args.context_tokens)
        conts = [m.tokenizer.encode(f" option {i}: the variance was {i * 13 % 97} percent in region {chr(65 + i)}.")
                 [:10] for i in range(args.options)]
        eng.score(ctx, conts)  # the context cached
        mx.reset_peak_memory()
        rs, wall, med = best(lambda: eng.score(ctx, conts), args.repeat)
        out["engine_score_cached"] = {"wall_s": wall, "median_s": med, "mode": rs[0].stats["mode"],
                                      "cached_tokens": rs[0].stats["cached_tokens"],
                                      "continuation_tokens": sum(len(c) for c in conts),
                                      "peak_memory_bytes": int(mx.get_peak_memory())}
        if kv:
            mx.reset_peak_memory()
            one, s_wall, s_med = best(lambda: serial(eng, ctx, conts), args.repeat)
            out["engine_score_cached_serial"] = {"wall_s": s_wall, "median_s": s_med, "mode": one[0].stats["mode"],
                                                 "cached_tokens": one[0].stats["cached_tokens"],
                                                 "peak_memory_bytes": int(mx.get_peak_memory())}
            out["max_abs_token_logprob_diff_vs_serial"] = max(
                abs(a - b) for r, w in zip(rs, one) for a, b in zip(r.token_logprobs, w.token_logprobs))
            out["greedy_flags_equal_serial"] = [r.greedy for r in rs] == [r.greedy for r in one]
            out["serial_over_batched"] = s_wall / wall
        _, wall_off, _ = best(lambda: eng.score(ctx, conts, use_cache=False), 1)
        out["engine_score_cache_off"] = {"wall_s": wall_off}

        cache = make_prompt_cache(m.model)  # the floor: all continuation tokens in one forward over the context
        mx.eval(m.model(mx.array(ctx)[None], cache=cache))
        mx.eval([c.state for c in cache])
        together = mx.array([t for c in conts for t in c])[None]

        def floor():
            mx.eval(m.model(together, cache=copy.deepcopy(cache)))

        _, floor_wall, _ = best(floor, args.repeat)
        out["one_forward_of_all_continuation_tokens"] = {"wall_s": floor_wall}

        def lm_eval_style():
            scores = []
            for c in conts:
                lp = m.model(mx.array(ctx + c)[None])[0, len(ctx) - 1 : -1].astype(mx.float32)
                lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
                scores.append([float(lp[j, t]) for j, t in enumerate(c)])
            return scores

        if not (kv or args.skip_mlx_lm):
            ref, lm_wall, _ = best(lm_eval_style, 1)
            out["mlx_lm_full_forward_per_continuation"] = {"wall_s": lm_wall}
            out["max_abs_token_logprob_diff_vs_mlx_lm"] = max(
                abs(a - b) for r, w in zip(rs, ref) for a, b in zip(r.token_logprobs, w))
            out["speedup_vs_lm_eval_style"] = lm_wall / wall
    out["score_over_floor"] = wall / floor_wall  # (the floor's KV in float32)
    out["load_after"] = loadavg()
    out["targets"] = {"score_over_floor": "<= 2"}
    emit(out)


if __name__ == "__main__":
    main()
