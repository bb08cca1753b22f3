"""A tiny random llama model directory that mlx-lm loads, for tests that need
a real model but not good text. Byte-level tokenizer, ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def save_byte_level_tokenizer(path: Path, specials: list[str], plain: list[str] = ()) -> int:
    """tokenizer.json: `specials` (ids 0..), then the 256 byte tokens, no merges, then `plain` (added tokens
    that are not special, as Qwen3's <think> and <tool_call>); returns the vocab size."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(specials)}
    for tok in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    tk.save(str(path / "tokenizer.json"))
    return len(vocab) + len(plain)


def build_tokenizer(path: Path) -> int:
    vocab = save_byte_level_tokenizer(path, SPECIALS)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "chat_template": CHATML,
                "model_max_length": 4096,
            }
        )
    )
    return vocab


def build_tiny_model(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64, dtype: str = "float32",
                     tokenizer=build_tokenizer, eos_token_id: int | list = 2, heads: int = 4, kv_heads: int = 2,
                     head_dim: int | None = None) -> Path:
    """tokenizer(path) writes the tokenizer files and returns the vocab size. heads, kv_heads, head_dim: the
    attention's geometry (head_dim None: hidden // heads); many KV heads over a tiny hidden size give a large
    KV state at little compute (an 8B model's KV: 32 layers, 8 KV heads of 128)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = tokenizer(path)
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        **({"head_dim": head_dim} if head_dim else {}),
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "eos_token_id": eos_token_id,
    }
    (path / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    # Larger than default init so greedy decoding is not stuck on one token.
    weights = {k: (v * 4).astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path
