"""RAM held by questions over one document, before and after a restart with prefetch (issue 50), JSON.

One process asks N questions about one document (the questions' states share the document's
buffers) and closes; a new process loads the model, waits for the prefetch and reports what RAM
holds. Restored checkpoints that share SSD blocks share buffers (cache/loading.py `_share`), so
after/before should stay near 1 (target <= 1.25). Also: the prefetch's seconds, the bytes it read
and the first question's TTFT after the restart (a RAM hit).

    python benchmarks/bench_restore_sharing.py [--tokens 1536] [--questions 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import default_model, emit, prompt_tokens

from mlxcache_kernel.engine import Engine, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("--questions", type=int, default=8)
    a = ap.parse_args()
    model = default_model()
    params = SamplingParams(max_tokens=8)
    with tempfile.TemporaryDirectory() as tmp:
        with Engine(cache_dir=tmp, prefetch_budget_bytes=0) as eng:
            eng.load_model(model)
            doc = prompt_tokens(eng.models.get().tokenizer, a.tokens)
            asks = [doc + eng.models.get().tokenizer.encode(f" Question {i}: what is item {i * 7 + 3}?")
                    for i in range(a.questions)]
            answers = [eng.generate_tokens(q, params=params).tokens for q in asks]
            before = eng.stats()
            eng.flush()
        with Engine(cache_dir=tmp, prefetch_budget_bytes=1 << 34) as eng:
            t0 = time.perf_counter()
            info = eng.load_model(model)
            eng.cache.loading.wait_reads(600)
            prefetch_s = time.perf_counter() - t0
            after = eng.stats()
            r = eng.generate_tokens(asks[0], params=params)
    emit({"benchmark": "restore_sharing", "tokens": a.tokens, "questions": a.questions,
          "ram_before_bytes": before["ram_used_bytes"], "ram_after_bytes": after["ram_used_bytes"],
          "after_over_before": round(after["ram_used_bytes"] / before["ram_used_bytes"], 3),
          "restore_shared_bytes": after["restore_shared_bytes"], "prefetched": info["prefetch"]["checkpoints"],
          "prefetch_s": round(prefetch_s, 3), "ssd_restore_bytes": after["ssd_restore_bytes"],
          "ssd_bytes": after["ssd_bytes"], "first_question_source": r.stats["cache_source"],
          "first_question_ttft_s": r.stats["ttft_s"], "same_answer": r.tokens == answers[0]})


if __name__ == "__main__":
    main()
