"""Follow-up questions about a cached video clip against the same request cold,
on the tiny random-weight Qwen2-VL of tests/support/tiny_vlm.py. TTFT here is
the wall time of the whole `generate` call for one token: decoding and sampling
the .mp4 (OpenCV, as mlx-vlm reads it), the processor, identities and the
lookup included.

One clip (`--frames` frames of 112x112 at 4 fps, sampled at `--fps`; 16 tokens
per frame pair) and about
`--text` tokens of text after it, then questions about them. Cold: the cache
off (the encoder runs and the whole prompt is prefilled every time).
Follow-up: a different question after the first one was asked, served from RAM;
and from SSD by a new Engine on the same directory (prefetch off, so the
lookup's own restore is measured). Reports the TTFT medians and ratios (target
<= 0.2), encoder runs saved, and whether the follow-ups' tokens (8 of them)
equal the cold run's.

    .venv/bin/python benchmarks/bench_video.py [--text 1000] [--frames 32] [--fps 4] [--repeats 5]
    .venv/bin/python benchmarks/bench_video.py --audio 10     # a 10 s WAV on the tiny Gemma 4 instead
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_vision import document  # noqa: E402
from common import emit, median  # noqa: E402

from mlxcache_kernel.engine import Engine  # noqa: E402
from mlxcache_kernel.engine.media.prompt import prompt_for  # noqa: E402
from tiny_vlm import build_vlm, make_clip, write_mp4, write_wav  # noqa: E402

SSD_RESTARTS = 3
SIZE = (112, 112)


def timed(eng: Engine, prompt: str, media: dict, **kw):
    """(wall seconds to the first token, result) of the whole call with max_tokens=1."""
    t0 = time.perf_counter()
    r = eng.generate(prompt, **media, max_tokens=1, **kw)
    return time.perf_counter() - t0, r


def run_questions(eng: Engine, doc: str, media: dict, key: str, questions: list, **kw) -> dict:
    ttft, sources, items = [], [], []
    for q in questions:
        t, r = timed(eng, doc + q, media, **kw)
        ttft.append(t)
        sources.append(r.stats["cache_source"])
        items += r.stats[key]
    tokens = [eng.generate(doc + q, **media, max_tokens=8, **kw).tokens for q in questions]
    return {"ttft": ttft, "sources": sources, "items": items, "tokens": tokens}


def video_setup(root: Path, frames: int, fps: float) -> tuple:
    """(model, media, warm-up media, sources key) for the clip on the tiny Qwen2-VL."""
    model = build_vlm("qwen2_vl", root / "qwen2_vl")
    # a video budget that keeps every frame at 112x112 (the tiny model's default would shrink a long clip's
    # frames to 28x28); as a checkpoint's video_preprocessor_config.json sets it
    config = json.loads((model / "preprocessor_config.json").read_text())
    (model / "video_preprocessor_config.json").write_text(json.dumps({**config, "max_pixels": frames * SIZE[0] * SIZE[1]}))
    clip = str(write_mp4(root / "clip.mp4", make_clip(5, frames, SIZE)))
    warm = str(write_mp4(root / "warm.mp4", make_clip(99, 4, SIZE)))
    return model, {"videos": [clip], "fps": fps}, {"videos": [warm]}, "video_sources"


def audio_setup(root: Path, seconds: float) -> tuple:
    """(model, media, warm-up media, sources key) for a recording on the tiny Gemma 4."""
    model = build_vlm("gemma4", root / "gemma4")
    rec, warm = write_wav(root / "rec.wav", 5, seconds), write_wav(root / "warm.wav", 99, 1.0)
    return model, {"audios": [str(rec)]}, {"audios": [str(warm)]}, "audio_sources"


def bench(root: Path, text: int, repeats: int, setup: tuple) -> dict:
    model, media, warm, key = setup
    doc = document(text)
    questions = [f"\nQuestion {i}: what happens to item {i} in the clip?" for i in range(repeats + 1 + SSD_RESTARTS)]
    cache_dir = root / "cache"
    with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:
        eng.load_model(model)
        eng.generate("warm-up", **warm, max_tokens=2, use_cache=False)  # the first forward and read of a process
        cold = run_questions(eng, doc, media, key, questions[1:repeats + 1], use_cache=False)
        before = eng.stats()["vision_encoder_runs"]
        first = eng.generate(doc + questions[0], **media, max_tokens=8)
        p = prompt_for(eng, eng.models.get(), doc + questions[0], None, system=None, raw=False, session=None, **media)
        n_media = sum(e - s for s, e, _ in p.spans)
        frames = len(p.images[0].indices) if "videos" in media else None
        ram = run_questions(eng, doc, media, key, questions[1:repeats + 1])
        ram_runs = eng.stats()["vision_encoder_runs"] - before - 1
        encoder_s = eng.stats()["vision_encoder_s"] / eng.stats()["vision_encoder_runs"]
        cold_tokens = {q: eng.generate(doc + q, **media, max_tokens=8, use_cache=False).tokens
                       for q in questions[repeats + 1:]}
    t_ssd, ssd_runs, ssd_exact, ssd_sources = [], 0, True, []
    for q in questions[repeats + 1:]:  # restarts: each follow-up (a new question) from SSD
        with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:
            eng.load_model(model)
            eng.generate("warm-up", **warm, max_tokens=2, use_cache=False)
            t, r_ssd = timed(eng, doc + q, media)
            t_ssd.append(t)
            ssd_sources += [r_ssd.stats["cache_source"]] + r_ssd.stats[key]
            ssd_runs += eng.stats()["vision_encoder_runs"] - 1
            ssd_exact &= eng.generate(doc + q, **media, max_tokens=8).tokens == cold_tokens[q]
    cold_ttft, ram_ttft = median(cold["ttft"]), median(ram["ttft"])
    return {
        "prompt_tokens": first.stats["prompt_tokens"],
        "media_tokens": n_media,
        **({"frames_sampled": frames} if frames is not None else {}),
        "encoder_run_s": encoder_s,
        "cold_ttft_s": cold_ttft,
        "followup_ram_ttft_s": ram_ttft,
        "ttft_ratio_ram": ram_ttft / cold_ttft,
        "followup_ram_sources": sorted(set(ram["sources"])),
        "followup_ram_media_sources": sorted(set(ram["items"])),
        "followup_ssd_ttft_s": median(t_ssd),
        "ttft_ratio_ssd": median(t_ssd) / cold_ttft,
        "followup_ssd_sources": sorted(set(ssd_sources)),
        "followup_cached_tokens": r_ssd.stats["cached_tokens"],
        "followups": 2 * repeats + 2 * SSD_RESTARTS,
        "encoder_runs_saved": 2 * repeats + 2 * SSD_RESTARTS - (ram_runs + ssd_runs),
        "tokens_match_cold_ram": ram["tokens"] == cold["tokens"],
        "tokens_match_cold_ssd": ssd_exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", type=int, default=1000, help="text tokens after the clip (about)")
    ap.add_argument("--frames", type=int, default=32, help="frames in the .mp4 (4 fps)")
    ap.add_argument("--fps", type=float, default=4.0, help="sampling rate passed to generate")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--audio", type=float, default=None, metavar="SECONDS",
                    help="instead of the clip: a recording of SECONDS on the tiny Gemma 4")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        setup = audio_setup(Path(d), args.audio) if args.audio else video_setup(Path(d), args.frames, args.fps)
        result = bench(Path(d), args.text, args.repeats, setup)
    media = {"audio_seconds": args.audio} if args.audio else {"frames": args.frames, "fps": args.fps}
    emit({"benchmark": "audio_followup" if args.audio else "video_followup", "text_tokens": args.text, **media,
          "repeats": args.repeats, "loadavg": open("/proc/loadavg").read().split()[:3], "target_ttft_ratio": 0.2,
          "results": result})


if __name__ == "__main__":
    main()
