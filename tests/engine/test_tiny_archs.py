"""Self-test of tests/support/tiny_archs.py: each tiny arch loads through mlx_lm.load,
yields the cache classes ARCHS promises, and greedy decoding moves."""

import pytest
from tiny_archs import ARCH_CACHES, ARCHS, CACHE_LIST_INNER, WINDOW, build_arch_model

PROMPT = "The quick brown fox jumps over the lazy dog, again and again."  # 61 byte tokens > WINDOW


def test_archs_table():
    assert set(ARCHS) == set(ARCH_CACHES)
    for required in ("llama", "gemma3_text", "gpt_oss", "qwen3_next", "qwen3_5", "lfm2", "mamba2"):
        assert required in ARCHS
    kinds = {k for caches in ARCH_CACHES.values() for k in caches}
    assert {"KVCache", "RotatingKVCache", "ArraysCache", "ChunkedKVCache", "CacheList"} <= kinds
    with pytest.raises(ValueError, match="unknown arch"):
        build_arch_model("no_such_arch", "/nonexistent")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_arch_loads_and_generates(arch, tmp_path):
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    path = build_arch_model(arch, tmp_path / arch)
    assert (
        build_arch_model(arch, tmp_path / "again").joinpath("model.safetensors").read_bytes()
        == (path / "model.safetensors").read_bytes()
    )  # deterministic for a seed
    model, tokenizer = mlx_lm.load(str(path))
    assert tokenizer.eos_token_id == 2

    cache = make_prompt_cache(model)
    assert tuple(type(c).__name__ for c in cache) == ARCH_CACHES[arch]
    if arch in CACHE_LIST_INNER:
        inner = tuple(tuple(type(x).__name__ for x in c.caches) for c in cache)
        assert inner == CACHE_LIST_INNER[arch]

    prompt = tokenizer.encode(PROMPT)
    assert len(prompt) > WINDOW  # sliding / chunked caches wrap during the prompt
    # Prefill in chunks of 16 so the window also wraps across prefill steps.
    steps = generate_step(mx.array(prompt), model, max_tokens=20, prompt_cache=cache, prefill_step_size=16)
    tokens = [int(tok) for tok, _ in steps]
    assert len(tokens) == 20
    assert len(set(tokens)) >= 3, tokens
