"""A fresh process on a cache directory for the VLM tests: loads the model, runs
the requests it reads as a JSON list on stdin, prints one JSON list of results.

    python vision_worker.py CACHE_DIR MODEL_DIR [IMAGE_ATTENTION]

A request: {"prompt", "images": [paths], "videos": [paths], "audios": [paths], "fps", "max_frames", "temperature", "seed",
"system", "max_tokens", "raw"}.
"""

from __future__ import annotations

import json
import sys

from mlxcache_kernel.engine import Engine

KEEP = ("cache_source", "cached_tokens", "prefilled_tokens", "prompt_tokens", "image_sources", "video_sources", "audio_sources")


def main() -> None:
    cache_dir, model_dir = sys.argv[1], sys.argv[2]
    policy = sys.argv[3] if len(sys.argv) > 3 else None
    out = []
    with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:
        eng.load_model(model_dir, image_attention=policy)
        for req in json.loads(sys.stdin.read()):
            r = eng.generate(req["prompt"], images=req.get("images"), videos=req.get("videos"), fps=req.get("fps"),
                             max_frames=req.get("max_frames"), audios=req.get("audios"), max_tokens=req.get("max_tokens", 12),
                             temperature=req.get("temperature", 0.0), seed=req.get("seed", 0), system=req.get("system"),
                             raw=req.get("raw", False))
            out.append({"tokens": r.tokens, **{k: r.stats.get(k) for k in KEEP},
                        "encoder_runs": eng.stats()["vision_encoder_runs"]})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
