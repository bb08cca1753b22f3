"""Retention policies replayed on access traces (issue "Memory the kernel really has"), JSON on stdout.

Traces: every `benchmarks/traces/*.jsonl` (recorded from the example
notebooks with MLXCACHE_TRACE set, see docs/benchmarks.md) and a synthetic
notebook day: a long document asked many questions, several chats growing
turn by turn, reruns of earlier cells, in a seeded random order.

Each trace is replayed through the real RAM tier (`RamTier`, array-less
checkpoints of the recorded sizes) under a budget of a third of the trace's
distinct KV bytes, once per policy, with an SSD tier below that holds every
checkpoint ever published. Per policy: RAM misses (requests RAM served less
than SSD could), prefill seconds RAM hits avoided, bytes reloaded from SSD,
peak RAM residency.

    python benchmarks/bench_retention.py [--budget-share 0.33]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from common import emit

from mlxcache_kernel.engine.cache.ram import RamTier
from mlxcache_kernel.engine.cache.retention import POLICIES, make_policy, prefill_cost
from mlxcache_kernel.engine.kv.checkpoint import Checkpoint

TRACES = Path(__file__).parent / "traces"


def synthetic_day(seed: int = 0) -> list[dict]:
    """A notebook day on a 135M model: 46 KB of KV per token, ~100 prompt tokens/s."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(3, 49152) for _ in range(n)]  # noqa: E731
    template, doc = tok(30), tok(2000)
    requests = []
    questions = [template + doc + tok(rng.randrange(15, 40)) for _ in range(12)]
    chats = [[template + tok(40)] for _ in range(3)]
    for _ in range(60):
        roll = rng.random()
        if roll < 0.35:
            prompt = rng.choice(questions)
        elif roll < 0.8:
            chat = rng.choice(chats)
            prompt = chat[-1] + tok(60) + tok(20)  # the last turn, the reply, a new question
            chat.append(prompt)
        else:
            prompt = rng.choice([r["prompt"] for r in requests] or questions)  # a rerun
        requests.append({"ns": "m", "prompt": prompt, "kept": len(prompt) + 24, "kv_bytes_per_token": 46080,
                         "prefill_tokens_per_s": 100.0})
    return requests


def replay(trace: list[dict], policy: str, budget: int) -> dict:
    cache = RamTier(budget, retention=make_policy(policy))
    on_ssd: dict = {}  # (ns, tokens) -> Checkpoint: every state ever published
    out = {"requests": len(trace), "ram_misses": 0, "avoided_prefill_s": 0.0, "reload_bytes": 0, "peak_bytes": 0}
    for r in trace:
        prompt, ns, rate = r["prompt"], r["ns"], r.get("prefill_tokens_per_s") or 100.0
        lease = cache.take(prompt, ns)
        n_ram = lease.length if lease else 0
        if lease:
            lease.release()
        best_ssd = max((min(_common(k[1], prompt), len(prompt) - 1) for k in on_ssd if k[0] == ns), default=0)
        if best_ssd > n_ram:
            out["ram_misses"] += 1
            out["reload_bytes"] += int(r["kv_bytes_per_token"] * best_ssd)
        seconds = lambda n: prefill_cost(n) / rate  # noqa: E731
        out["avoided_prefill_s"] += seconds(n_ram)
        final = tuple(prompt) + tuple(range(-1, -1 - (r["kept"] - len(prompt)), -1))  # generated tokens
        cp = Checkpoint(final, (), int(r["kv_bytes_per_token"] * len(final)))
        cache.put(cp, ns)
        on_ssd[(ns, final)] = cp
        out["peak_bytes"] = max(out["peak_bytes"], cache.used_bytes)
    return out


def _common(a: tuple, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-share", type=float, default=0.33)
    args = ap.parse_args()
    traces = {"synthetic_day": synthetic_day()}
    for path in sorted(TRACES.glob("*.jsonl")):
        traces[path.stem] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    results = {}
    for name, trace in traces.items():
        distinct = {(r["ns"], tuple(r["prompt"])): r["kv_bytes_per_token"] * r["kept"] for r in trace}
        budget = int(args.budget_share * sum(distinct.values()))
        results[name] = {"budget_bytes": budget,
                         **{p: replay(trace, p, budget) for p in POLICIES}}
    totals = {p: {k: sum(results[t][p][k] for t in results) for k in ("ram_misses", "avoided_prefill_s")}
              for p in POLICIES}
    best = max(POLICIES, key=lambda p: (totals[p]["avoided_prefill_s"], -totals[p]["ram_misses"]))
    emit({"benchmark": "retention", "traces": results, "totals": totals, "best_by_avoided_prefill": best})


if __name__ == "__main__":
    main()
