"""Follow-up questions about a cached image against the same request cold, on
the tiny random-weight VLMs of tests/support/tiny_vlm.py (Qwen2-VL, Gemma 3).
TTFT here is the wall time of the whole `generate` call for one token: image
loading, the processor, identities and the lookup included.

Per architecture: one image and about `--text` tokens of text after it, then
questions about them. Cold: the cache off (the encoder runs and the whole
prompt is prefilled every time). Follow-up: a different question after the
first one was asked, served from RAM; and from SSD by a new Engine on the same
directory (prefetch off, so the lookup's own restore is measured). Reports the
TTFT medians and ratios (target <= 0.2), encoder runs saved, and whether the
follow-up's tokens equal the cold run's.

    .venv/bin/python benchmarks/bench_vision.py [--text 1000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from common import emit, median  # noqa: E402

from mlxcache_kernel.engine import Engine  # noqa: E402
from tiny_vlm import build_vlm, make_image  # noqa: E402

SIZES = {"qwen2_vl": (112, 84), "gemma3": (56, 56)}
SSD_RESTARTS = 3


def document(n_chars: int) -> str:
    """English-like text of about n_chars characters (the tiny tokenizers are byte-level)."""
    parts, i = [], 0
    while sum(map(len, parts)) < n_chars:
        parts.append(f"Note {i}: the harbour light was {['grey', 'amber', 'blue'][i % 3]} at {i % 24} o'clock. ")
        i += 1
    return "".join(parts)[:n_chars]


def timed(eng: Engine, prompt: str, img, **kw):
    """(wall seconds to the first token, result): the whole call with max_tokens=1, image
    loading, processing and identity included; then the same request for 8 tokens."""
    t0 = time.perf_counter()
    r1 = eng.generate(prompt, images=[img], max_tokens=1, **kw)
    return time.perf_counter() - t0, r1


def run_questions(eng: Engine, doc: str, img, questions: list, **kw) -> dict:
    ttft, sources, images = [], [], []
    for q in questions:
        t, r = timed(eng, doc + q, img, **kw)
        ttft.append(t)
        sources.append(r.stats["cache_source"])
        images += r.stats["image_sources"]
    texts = [eng.generate(doc + q, images=[img], max_tokens=8, **kw).tokens for q in questions]
    return {"ttft": ttft, "sources": sources, "image_sources": images, "tokens": texts}


def bench_arch(arch: str, root: Path, text: int, repeats: int) -> dict:
    model = build_vlm(arch, root / arch)
    img = make_image(5, SIZES[arch])
    doc = document(text)
    questions = [f"\nQuestion {i}: what does the picture show about item {i}?"
                 for i in range(repeats + 1 + SSD_RESTARTS)]
    cache_dir = root / f"cache-{arch}"
    with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:
        eng.load_model(model)
        eng.generate("warm-up", images=[make_image(99, SIZES[arch])], max_tokens=2, use_cache=False)
        cold = run_questions(eng, doc, img, questions[1:repeats + 1], use_cache=False)
        before = eng.stats()["vision_encoder_runs"]
        first = eng.generate(doc + questions[0], images=[img], max_tokens=8)
        ram = run_questions(eng, doc, img, questions[1:repeats + 1])
        ram_runs = eng.stats()["vision_encoder_runs"] - before - 1
        encoder_s = eng.stats()["vision_encoder_s"] / eng.stats()["vision_encoder_runs"]
    t_ssd, ssd_runs = [], 0
    for q in questions[len(questions) - SSD_RESTARTS:]:  # restarts: each follow-up (a new question) from SSD
        with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:
            eng.load_model(model)
            eng.generate("warm-up", images=[make_image(99, SIZES[arch])], max_tokens=2, use_cache=False)
            t, r_ssd = timed(eng, doc + q, img)
            t_ssd.append(t)
            ssd_runs += eng.stats()["vision_encoder_runs"] - 1
    cold_ttft, ram_ttft = median(cold["ttft"]), median(ram["ttft"])
    return {
        "prompt_tokens": first.stats["prompt_tokens"],
        "encoder_run_s": encoder_s,
        "cold_ttft_s": cold_ttft,
        "followup_ram_ttft_s": ram_ttft,
        "ttft_ratio_ram": ram_ttft / cold_ttft,
        "followup_ram_sources": sorted(set(ram["sources"])),
        "followup_ssd_ttft_s": median(t_ssd),
        "ttft_ratio_ssd": median(t_ssd) / cold_ttft,
        "followup_ssd_source": r_ssd.stats["cache_source"],
        "followup_cached_tokens": r_ssd.stats["cached_tokens"],
        "followup_image_sources": sorted(set(ram["image_sources"] + r_ssd.stats["image_sources"])),
        "followups": 2 * repeats + SSD_RESTARTS,  # RAM (1 and 8 tokens each) and SSD
        "encoder_runs_saved": 2 * repeats + SSD_RESTARTS - (ram_runs + ssd_runs),
        "encoder_s_saved": (2 * repeats + SSD_RESTARTS - (ram_runs + ssd_runs)) * encoder_s,
        "tokens_match_cold": ram["tokens"] == cold["tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", type=int, default=1000, help="text tokens after the image (about)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        results = {arch: bench_arch(arch, Path(d), args.text, args.repeats) for arch in SIZES}
    emit({"benchmark": "vision_followup", "text_tokens": args.text, "repeats": args.repeats,
          "loadavg": open("/proc/loadavg").read().split()[:3], "target_ttft_ratio": 0.2, "results": results})


if __name__ == "__main__":
    main()
