"""A tiny random LoRA adapter in mlx-lm's own format, for a tiny model directory.

``build_adapter(model_dir, out)`` converts the model's linear layers with mlx-lm's
``linear_to_lora_layers`` (its LoRA layers), gives the B matrices random values
(mlx-lm starts them at zero, which would leave the output unchanged) and saves
``adapters.safetensors`` + ``adapter_config.json`` as ``mlx_lm.lora`` does, so
``mlx_lm.load(path, adapter_path=out)`` (and ``Engine.load_model(adapter_path=out)``) loads it.
"""

from __future__ import annotations

import json
from pathlib import Path


def build_adapter(model_dir: Path, out: Path, *, seed: int = 0, rank: int = 4, scale: float = 4.0) -> Path:
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model, _ = mlx_lm.load(str(model_dir))
    config = json.loads((Path(model_dir) / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    lora = {"rank": rank, "scale": scale, "dropout": 0.0}
    mx.random.seed(seed)
    linear_to_lora_layers(model, layers, lora)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("lora_a"):
            weights[name] = value
        elif name.endswith("lora_b"):
            weights[name] = mx.random.normal(value.shape) * 0.1
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": layers, "lora_parameters": lora, "seed": seed}, indent=1))
    return out
