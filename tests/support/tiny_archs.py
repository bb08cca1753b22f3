"""Tiny random-weight model directories for real mlx-lm architectures, one per
kind of mlx-lm cache, for cache tests that must cover every cache class.

``build_arch_model(arch, path)`` writes config.json + model.safetensors + the
byte-level tokenizer of ``tiny_model`` into ``path``; ``mlx_lm.load(path)``
(and so ``Engine.load_model(path)``) loads it. Weights come from the
architecture's own ``mlx_lm.models.<arch>.Model``, with the matrices scaled up
so greedy decoding moves between tokens instead of repeating one.

``ARCHS`` maps each supported arch (mlx-lm ``model_type``) to a note of the
cache classes its ``make_prompt_cache(model)`` yields, in layer order;
``ARCH_CACHES`` gives the same as a tuple of class names per layer, and
``CACHE_LIST_INNER`` the classes inside each ``CacheList``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_model import build_tokenizer

EOS_ID = 2  # "<|im_end|>" in tiny_model's byte-level tokenizer
WINDOW = 32  # sliding window / attention chunk, small so a short prompt wraps it

# Per-layer cache class names that make_prompt_cache(model) yields.
ARCH_CACHES: dict[str, tuple[str, ...]] = {
    "llama": ("KVCache", "KVCache"),
    "gemma3_text": ("RotatingKVCache", "KVCache"),
    "gpt_oss": ("RotatingKVCache", "KVCache"),
    "qwen3_next": ("ArraysCache", "KVCache"),
    "qwen3_5": ("ArraysCache", "KVCache"),
    "lfm2": ("ArraysCache", "KVCache"),
    "mamba2": ("ArraysCache", "ArraysCache"),
    "llama4": ("ChunkedKVCache", "ChunkedKVCache", "ChunkedKVCache", "KVCache"),
    "falcon_h1": ("CacheList", "CacheList"),
    "baichuan_m1": ("CacheList", "CacheList"),
}
# For the CacheList archs: the classes inside each layer's CacheList (its .caches).
CACHE_LIST_INNER: dict[str, tuple[tuple[str, ...], ...]] = {
    "falcon_h1": (("ArraysCache", "KVCache"), ("ArraysCache", "KVCache")),
    "baichuan_m1": (("ArraysCache", "RotatingKVCache"), ("ArraysCache", "KVCache")),
}

ARCHS: dict[str, str] = {
    "llama": "KVCache on every layer (2 layers)",
    "gemma3_text": f"RotatingKVCache(max_size={WINDOW}) sliding layer + KVCache global layer",
    "gpt_oss": f"RotatingKVCache(max_size={WINDOW}) sliding layer + KVCache full layer; MoE 4 experts top-2",
    "qwen3_next": "ArraysCache(size=2) gated-delta linear-attention layer + KVCache full layer; MoE 4 experts top-2",
    "qwen3_5": "ArraysCache(size=2) gated-delta linear-attention layer + KVCache full layer (dense MLP)",
    "lfm2": "ArraysCache(size=1) short-conv layer + KVCache attention layer",
    "mamba2": "ArraysCache(size=2) (conv + SSM state; mlx-lm's MambaCache) on every layer, no KV cache",
    "llama4": f"ChunkedKVCache(chunk_size={WINDOW}) on layers 0-2 + KVCache on layer 3; MoE 4 experts top-1",
    "falcon_h1": "CacheList(ArraysCache(size=2), KVCache) on every layer (parallel mamba + attention)",
    "baichuan_m1": f"CacheList(ArraysCache(size=2), RotatingKVCache(max_size={WINDOW})) sliding layer"
    " + CacheList(ArraysCache(size=2), KVCache) full layer",
}
# More families whose attention differs (plain KV caches): what a hit must work for as well.
FAMILIES: dict[str, str] = {
    "qwen2": "KVCache on every layer, attention biases",
    "deepseek_v3": "multi-head latent attention: KVCache holding latents and rope keys",
    "gemma2": "KVCache on every layer, its own softmax with logit soft-capping",
}


def _config(arch: str, vocab: int) -> dict:
    """config.json for a tiny model of ``arch`` (hidden size 64)."""
    common = {"vocab_size": vocab, "eos_token_id": EOS_ID, "max_position_embeddings": 4096}
    if arch == "llama":
        return {
            "model_type": "llama",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            **common,
        }
    if arch == "gemma3_text":
        return {
            "model_type": "gemma3_text",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "sliding_window": WINDOW,
            "sliding_window_pattern": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            **common,
        }
    if arch == "gpt_oss":
        return {
            "model_type": "gpt_oss",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 150000,
            "rope_scaling": None,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            **common,
        }
    if arch in ("qwen3_next", "qwen3_5"):
        text = {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 2,  # layer 0 linear, layer 1 full attention
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            **common,
        }
        if arch == "qwen3_next":
            return {
                "model_type": "qwen3_next",
                **text,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
                "mlp_only_layers": [],
                "norm_topk_prob": True,
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            }
        text.update(
            model_type="qwen3_5_text",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            layer_types=["linear_attention", "full_attention"],
        )
        return {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": False, **common}
    if arch == "lfm2":
        return {
            "model_type": "lfm2",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": 64,
            "block_ff_dim": 128,
            "block_multiple_of": 16,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "rope_theta": 1_000_000.0,
            "layer_types": ["conv", "full_attention"],
            **common,
        }
    if arch == "mamba2":
        return {
            "model_type": "mamba2",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "expand": 2,
            "num_heads": 8,
            "head_dim": 16,  # transformers: hidden_size * expand == num_heads * head_dim
            "intermediate_size": 128,
            "state_size": 16,
            "n_groups": 1,
            "conv_kernel": 4,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_limit": [0.0, 1e4],
            "time_step_rank": "auto",
            "chunk_size": WINDOW,
            "tie_word_embeddings": True,
            **common,
        }
    if arch == "llama4":
        text = {
            "model_type": "llama4_text",
            "hidden_size": 64,
            "num_hidden_layers": 4,  # layers 0-2 chunked attention, layer 3 global
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "attention_bias": False,
            "attention_chunk_size": WINDOW,
            "interleave_moe_layer_step": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,  # mlx-lm's llama4 supports top-1 only
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": None,
            "use_qk_norm": True,
            **common,
        }
        return {"model_type": "llama4", "text_config": text, **common}
    if arch == "falcon_h1":
        return {
            "model_type": "falcon_h1",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "mamba_d_ssm": 128,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_n_groups": 1,
            "mamba_chunk_size": WINDOW,
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
            **common,
        }
    if arch == "baichuan_m1":
        return {
            "model_type": "baichuan_m1",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 10000.0,
            "sliding_window": WINDOW,
            "sliding_window_layers": [0],
            "conv_window": 2,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            **common,
        }
    if arch == "deepseek_v3":  # multi-head latent attention: the cache holds latents and rope keys
        return {
            "model_type": "deepseek_v3",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,  # layer 0 dense, layer 1 MoE
            "n_group": 1,
            "topk_group": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": 48,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "qk_nope_head_dim": 16,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            **common,
        }
    if arch == "gemma2":  # attends with its own softmax (logit soft-capping), not mlx-lm's attention
        return {
            "model_type": "gemma2",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            **common,
        }
    if arch == "qwen2":
        return {
            "model_type": "qwen2",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "tie_word_embeddings": True,
            **common,
        }
    raise ValueError(f"unknown arch {arch!r}; supported: {', '.join([*ARCHS, *FAMILIES])}")


def build_arch_model(arch: str, path: Path, *, seed: int = 0, scale: float = 4.0, **config_overrides) -> Path:
    """Write a tiny random ``arch`` model directory at ``path`` (float32) and return it
    (`config_overrides`: config.json keys changed, e.g. head_dim=32 for KV quantized in groups of 32).

    Matrix weights (ndim >= 2: linear, embedding, expert and conv weights) are
    the architecture's default init times ``scale``; vectors (norms, biases,
    SSM A_log/D/dt_bias) keep their defaults.
    """
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    if arch not in ARCHS and arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join([*ARCHS, *FAMILIES])}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path)
    config = {**_config(arch, vocab), **config_overrides}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {k: (v * scale if v.ndim >= 2 else v).astype(mx.float32) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path
