"""Background restore and prefetch (issue 11), JSON on stdout.

a. restart: the first rerun 3 s after `load_model` in a new process (the
   prefetch has read the prompt's state back into RAM meanwhile) against a
   RAM hit's TTFT in the same process (after a flush). Target <= 1.25. Also
   shown: the same first rerun with prefetch off (the lookup restores from SSD).
b. queued: a rerun of the same cell while the previous run's SSD write is
   still queued (or being written) against one after a flush. Target <= 1.1.

TTFT is the engine's (`stats["ttft_s"]`, from the start of the generation)
and, in `_wall`, from the `generate()` call to the first streamed text, which
also counts the work `generate()` does first (applying finished reads).

    python benchmarks/bench_prefetch.py [--tokens 1536] [--repeats 5] [--parts restart,queued]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from common import default_model, emit, median, prompt_tokens

from mlxcache_kernel.engine import Engine, SamplingParams

PARAMS = SamplingParams(max_tokens=8)


def timed(eng: Engine, prompt: list, params: SamplingParams = PARAMS) -> dict:
    """One generation: engine TTFT, wall-clock TTFT from the call, where the prompt came from."""
    first = []
    t0 = time.perf_counter()
    r = eng.generate_tokens(prompt, params=params, on_text=lambda s: first or first.append(time.perf_counter()))
    return {"ttft_s": r.stats["ttft_s"], "ttft_wall_s": (first[0] if first else time.perf_counter()) - t0,
            "source": r.stats["cache_source"], "cached": r.stats["cached_tokens"], "tokens": r.tokens}


def _restart_child(cache_dir: str, model: str, tokens: int, prefetch: bool, wait_s: float) -> dict:
    """In a new process: load, wait, rerun (the measured run), flush, rerun (a RAM hit)."""
    eng = Engine(cache_dir=cache_dir, prefetch_budget_bytes=None if prefetch else 0)
    t0 = time.perf_counter()
    info = eng.load_model(model)
    load_s = time.perf_counter() - t0
    prompt = prompt_tokens(eng.models.get().tokenizer, tokens)
    time.sleep(wait_s)
    first = timed(eng, prompt)
    eng.flush()
    ram = timed(eng, prompt)
    s = eng.stats()
    eng.close()
    return {"load_s": load_s, "prefetch": info["prefetch"], "first": first, "ram_hit": ram,
            "ssd_restores": s["ssd_restores"], "prefetch_waits": s["prefetch_waits"]}


def bench_restart(model: str, tokens: int, repeats: int, wait_s: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        with Engine(cache_dir=d, prefetch_budget_bytes=0) as eng:  # the cold run, written to SSD
            eng.load_model(model)
            cold = timed(eng, prompt_tokens(eng.models.get().tokenizer, tokens))
        runs = {"prefetch": [], "no_prefetch": []}
        for _ in range(repeats):  # interleaved, each in a new process
            for mode in runs:
                out = subprocess.run([sys.executable, __file__, "_restart", d, model, str(tokens), mode, str(wait_s)],
                                     capture_output=True, text=True, check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for mode, rs in runs.items():
        assert all(r["first"]["tokens"] == cold["tokens"] == r["ram_hit"]["tokens"] for r in rs), mode
    out = {"prompt_tokens": tokens, "wait_after_load_s": wait_s, "cold_ttft_s": cold["ttft_s"]}
    for mode, rs in runs.items():
        first = [r["first"]["ttft_s"] for r in rs]
        ram = [r["ram_hit"]["ttft_s"] for r in rs]
        first_wall = [r["first"]["ttft_wall_s"] for r in rs]
        ram_wall = [r["ram_hit"]["ttft_wall_s"] for r in rs]
        out[mode] = {
            "first_rerun_source": sorted({r["first"]["source"] for r in rs}),
            "first_rerun_ttft_s": first, "ram_hit_ttft_s": ram,
            "first_rerun_ttft_wall_s": first_wall, "ram_hit_ttft_wall_s": ram_wall,
            "ratio": median(first) / median(ram), "ratio_wall": median(first_wall) / median(ram_wall),
            "load_s": median([r["load_s"] for r in rs]), "ssd_restores": sorted({r["ssd_restores"] for r in rs}),
        }
    out["target"] = "prefetch ratio <= 1.25"
    return out


def bench_queued(model: str, tokens: int, repeats: int) -> dict:
    """Reruns in one process: right after the previous run (its write queued) vs after a flush."""
    greedy = PARAMS
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d, prefetch_budget_bytes=0) as eng:
        eng.load_model(model)
        prompt = prompt_tokens(eng.models.get().tokenizer, tokens)
        cold = timed(eng, prompt)
        results = {"after_flush": [], "write_queued": []}
        pending, cancelled = [], eng.stats()["writes_cancelled"]
        for i in range(repeats):
            eng.flush()
            results["after_flush"].append(timed(eng, prompt, greedy))
            pending.append(eng.stats()["pending_writes"])  # the run just published: its write is queued
            results["write_queued"].append(timed(eng, prompt, greedy))
        s = eng.stats()
    assert all(r["tokens"] == cold["tokens"] for rs in results.values() for r in rs)
    q = [r["ttft_s"] for r in results["write_queued"]]
    f = [r["ttft_s"] for r in results["after_flush"]]
    qw = [r["ttft_wall_s"] for r in results["write_queued"]]
    fw = [r["ttft_wall_s"] for r in results["after_flush"]]
    return {
        "prompt_tokens": tokens, "cold_ttft_s": cold["ttft_s"],
        "write_queued_ttft_s": q, "after_flush_ttft_s": f, "write_queued_ttft_wall_s": qw, "after_flush_ttft_wall_s": fw,
        "pending_writes_at_rerun": pending, "writes_cancelled": s["writes_cancelled"] - cancelled,
        "handovers": s["handovers"], "ratio": median(q) / median(f), "ratio_wall": median(qw) / median(fw),
        "target": "ratio <= 1.1",
    }


def main() -> None:
    if sys.argv[1:2] == ["_restart"]:
        _, _, d, model, tokens, mode, wait_s = sys.argv
        print(json.dumps(_restart_child(d, model, int(tokens), mode == "prefetch", float(wait_s))))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--wait", type=float, default=3.0, help="seconds between load_model and the first rerun")
    ap.add_argument("--parts", default="restart,queued")
    args = ap.parse_args()
    model = default_model()
    out = {"benchmark": "prefetch", "model": model}
    parts = args.parts.split(",")
    if "restart" in parts:
        out["restart_first_rerun"] = bench_restart(model, args.tokens, args.repeats, args.wait)
    if "queued" in parts:
        out["rerun_with_write_queued"] = bench_queued(model, args.tokens, args.repeats)
    emit(out)


if __name__ == "__main__":
    main()
