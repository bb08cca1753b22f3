"""A tiny random model that never emits its end-of-sequence token under greedy decoding.

For tests that must interrupt or kill a generation while it runs: the lm_head
row of the eos token is zero (so its logit is 0 while ~258 others are random
±), which in practice never wins an argmax. Slower than tiny_model's default
(4 layers, hidden 256) so a generation lasts long enough to interrupt.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_model import build_tiny_model


def build_endless_model(path, *, layers: int = 4, hidden: int = 256) -> Path:
    import mlx.core as mx

    path = build_tiny_model(Path(path), layers=layers, hidden=hidden)
    config = json.loads((path / "config.json").read_text())
    weights = mx.load(str(path / "model.safetensors"))
    head = mx.array(weights["model.embed_tokens.weight"])
    eos = int(config["eos_token_id"])
    head[eos] = 0
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    return path
