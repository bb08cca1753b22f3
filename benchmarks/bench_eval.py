"""lm-evaluation-harness with the cached engine against mlx_lm.evaluate (issue 48), JSON on stdout.

On the default model, two local tasks (tests/support/local_tasks.py: a task YAML over a JSONL, no
network), each run by `lm_eval.simple_evaluate` in this process:

- multiple choice: 200 questions, 4 choices (" A" to " D"), the same ~600-token block of five
  examples before every question (the `first_n` few-shot sampler, as MMLU's gives), each question
  about as long as an example (~120 tokens);
- generate_until: 50 prompts, greedy, stopping at "\\n" or "." (max_gen_toks 64).

Timed: mlx_lm.evaluate's `MLXLM` (its batch size 8), `CachedLM` on an empty cache directory, a
rerun in the same process (RAM), and a rerun after a restart (a new engine on the same directory:
RAM empty, SSD as the first run left it). Reported: wall times, the speed-ups, per-request
log-likelihood differences against MLXLM, greedy flags and generations that differ, and whether
the task metrics are identical. Targets (issue 48): >= 10x on multiple choice, >= 3x on generation,
>= 50x after a restart.

    python benchmarks/bench_eval.py [--questions 200] [--prompts 50] [--detail 3] [--skip-mlx-lm]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from common import default_model, emit

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from local_tasks import write_tasks  # noqa: E402

from mlxcache_kernel.eval import CachedLM  # noqa: E402


def run(lm, manager, task: str) -> tuple[float, dict]:
    t = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True, verbosity="ERROR")
    return time.perf_counter() - t, out


def answers(result: dict, task: str) -> list:
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def metrics(result: dict) -> dict:
    return {t: {k: float(v) for k, v in r.items() if "," in k} for t, r in result["results"].items()}


def compare(ours: dict, theirs: dict, task: str, kind: str) -> dict:
    a, b = answers(ours, task), answers(theirs, task)
    if kind == "gen":
        return {"generations_differing": sum(x != y for x, y in zip(a, b)), "metrics_identical":
                metrics(ours) == metrics(theirs)}
    pairs = [(x[0], y[0]) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    return {"requests": len(pairs), "max_abs_logprob_diff": max(abs(x[0] - y[0]) for x, y in pairs),
            "greedy_differing": sum(bool(x[1]) != bool(y[1]) for x, y in pairs),
            "metrics_identical": metrics(ours) == metrics(theirs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--detail", type=int, default=3, help="notes per question (3: ~120 tokens, a ~600-token block)")
    ap.add_argument("--max-gen-toks", type=int, default=64)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    args = ap.parse_args()
    model = default_model()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tasks"
        names = write_tasks(folder, questions=args.questions, prompts=args.prompts, detail=args.detail,
                            max_gen_toks=args.max_gen_toks)
        manager = TaskManager(include_path=str(folder), include_defaults=False)
        out: dict = {"model": model, "questions": args.questions, "choices": 4, "shots": 5,
                     "prompts": args.prompts, "max_gen_toks": args.max_gen_toks}
        theirs = {}
        if not args.skip_mlx_lm:
            from mlx_lm.evaluate import MLXLM

            ref = MLXLM(model, use_chat_template=False)
            for kind in ("mc", "gen"):
                out[f"mlx_lm_{kind}_s"], theirs[kind] = run(ref, manager, names[kind])
            del ref
        cache_dir = str(Path(tmp) / "cache")
        lm = CachedLM(pretrained=model, cache_dir=cache_dir)
        for kind in ("mc", "gen"):
            out[f"cached_{kind}_cold_s"], ours = run(lm, manager, names[kind])
            out[f"cached_{kind}_rerun_s"], _ = run(lm, manager, names[kind])
            if kind in theirs:
                out[f"{kind}_vs_mlx_lm"] = compare(ours, theirs[kind], names[kind], kind)
        block = lm.engine.stats()
        out["prefilled_tokens_cold_and_rerun"] = block["engine_prefilled_tokens"]
        lm.close()  # its SSD writes durable: a restart finds them
        t = time.perf_counter()
        lm = CachedLM(pretrained=model, cache_dir=cache_dir)
        out["restart_load_s"] = time.perf_counter() - t
        for kind in ("mc", "gen"):
            out[f"cached_{kind}_restart_s"], _ = run(lm, manager, names[kind])
        out["prefilled_tokens_after_restart"] = lm.engine.stats()["engine_prefilled_tokens"]
        lm.close()
        for kind in ("mc", "gen") if theirs else ():
            base = out[f"mlx_lm_{kind}_s"]
            for phase in ("cold", "rerun", "restart"):
                out[f"speedup_{kind}_{phase}"] = round(base / out[f"cached_{kind}_{phase}_s"], 2)
        out["load"] = os.getloadavg()
    emit(out)


if __name__ == "__main__":
    main()
