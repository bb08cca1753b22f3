"""Trust, then verify (issue 49): what verifying a fetched state costs, and what the sampled check
at fetch time costs and catches (SmolLM2, CPU).

    .venv/bin/python benchmarks/bench_remote_verify.py [--lengths 2048 8192] [--arrivals 20] [--trials 40]
    .venv/bin/python benchmarks/bench_remote_verify.py --small      # a loaded machine: 1024 and 2048 tokens

The state is computed here with the engine's prefill chunk (as a writer would) and then treated as a
fetched one: the idle-time Recomputation (kv/recompute.py) and the sampled check only ever see a
Checkpoint, so where it came from does not change their cost.

- verify_cpu_s_per_token: CPU seconds (process time) of the whole recomputation per token;
  honest_max_error: the largest per-position relative error it saw against the writer's state
  (chunk noise; the tolerance is kv/recompute.py TOLERANCE).
- next_cell_delay_ms: a cell that arrives at a random moment during verification (a thread sets an
  event) waits for the step in progress: the time from its arrival to the end of that step, as the
  kernel's event loop would then run it. Target: under 50 ms.
- sample_ms: sampled_check (k positions through every layer) per lookup; caught_one_position: the
  share of trials in which a state with one position poisoned (layer 5) was caught (expected k/n:
  evaded with probability 1 - k/n); caught_throughout: a state with layers 1+ poisoned everywhere.
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

from common import default_model, emit, median, prompt_tokens


def state(eng, m, ids):
    eng.generate_tokens(ids, max_tokens=1, model="m")
    ns, tokens = eng.last_key
    return eng.cache.get_exact(tokens, ns).checkpoint.prefix(len(ids))


def poisoned(cp, layer: int, position: int | None):
    """cp with `layer`'s keys altered at one position (None: at every position)."""
    import mlx.core as mx

    from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
    from mlxcache_kernel.engine.kv.layers import LayerState

    l = cp.layers[layer]
    k, v = l.arrays
    noise = mx.random.normal(k.shape).astype(k.dtype)
    if position is not None:
        mask = (mx.arange(k.shape[-2]) == position)[None, None, :, None]
        noise = noise * mask
    bad = LayerState.whole(l.kind, (k + noise, v), dict(l.meta))
    return Checkpoint.of_layers(cp.tokens, tuple(bad if i == layer else x for i, x in enumerate(cp.layers)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--small", action="store_true", help="1024 and 2048 tokens, fewer trials (a loaded machine)")
    ap.add_argument("--arrivals", type=int, default=20)
    ap.add_argument("--trials", type=int, default=40)
    args = ap.parse_args()
    if args.small:
        args.lengths, args.arrivals, args.trials = [1024, 2048], 10, 20
    from mlxcache_kernel.engine import Engine
    from mlxcache_kernel.engine.kv import recompute

    eng = Engine(ssd=False)
    eng.load_model(default_model(), name="m")
    m = eng.models.get("m")
    rows = []
    for n in args.lengths:
        cp = state(eng, m, prompt_tokens(m.tokenizer, n))
        work = recompute.Recomputation(m, cp)
        c0, steps = time.process_time(), []
        while not work.finished:
            t = time.perf_counter()
            work.step()
            steps.append(time.perf_counter() - t)
        cpu = time.process_time() - c0
        assert work.mismatch is None, work.mismatch
        honest = work.max_error
        delays = []
        for _ in range(args.arrivals):  # a cell arriving mid-verification waits for the step in progress
            work, arrived, at = recompute.Recomputation(m, cp), threading.Event(), [0.0]
            timer = threading.Timer(random.uniform(0.05, 0.5), lambda: (at.__setitem__(0, time.perf_counter()),
                                                                          arrived.set()))
            timer.start()
            while not work.finished and not arrived.is_set():
                work.step()
            arrived.wait()
            delays.append(max(0.0, time.perf_counter() - at[0]))
        sample_ms, caught_one, caught_all = [], 0, 0
        for _ in range(5):
            t = time.perf_counter()
            assert recompute.sampled_check(m, cp) is True
            sample_ms.append((time.perf_counter() - t) * 1e3)
        for _ in range(args.trials):
            one = poisoned(cp, min(5, len(cp.layers) - 1), random.randrange(1, n))
            caught_one += isinstance(recompute.sampled_check(m, one), recompute.Mismatch)
        for _ in range(3):
            caught_all += isinstance(recompute.sampled_check(m, poisoned(cp, 1, None)), recompute.Mismatch)
        rows.append({"tokens": n, "verify_cpu_s_per_token": cpu / n, "verify_wall_s": sum(steps),
                     "steps": len(steps), "step_ms_median": median(steps) * 1e3, "step_ms_max": max(steps) * 1e3,
                     "honest_max_error": honest, "next_cell_delay_ms_median": median(delays) * 1e3,
                     "next_cell_delay_ms_max": max(delays) * 1e3, "sample_k": recompute.SAMPLED_POSITIONS,
                     "sample_ms_median": median(sample_ms), "caught_one_position": caught_one / args.trials,
                     "expected_k_over_n": recompute.SAMPLED_POSITIONS / (n - 1), "caught_throughout": caught_all / 3})
    eng.close()
    emit({"benchmark": "remote_verify", "model": default_model(), "dtype": str(cp.layers[0].arrays[0].dtype),
          "tolerance": {str(k): v for k, v in recompute.TOLERANCE.items()}, "rows": rows})


if __name__ == "__main__":
    main()
