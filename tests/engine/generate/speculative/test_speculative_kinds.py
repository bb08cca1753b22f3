"""Speculative decoding on every cache kind the engine caches (issue 31): sliding windows that wrap
during verification, recurrent state, chunked attention and lists of them are restored from before
the verify forward and the accepted tokens forwarded again (engine/generate/rewind.py), so the tokens equal
plain decoding's, greedy and seeded, cold and from the cache, with a draft that rejects often.

The regression: mlx-lm's speculative decoding checks trimmability once, at the start; a sliding
window that the verify step pushes past its size then trims nothing (`trim_prompt_cache` returns
0) and the full-attention layers stay untrimmed too: wrong tokens, no error. The window test below
is that case (the precondition checked with mlx-lm's own functions)."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm.models import cache as lm_cache
from tiny_archs import ARCHS, WINDOW, build_arch_model
from tiny_model import build_tiny_model

import mlx.core as mx
from mlx_lm import load as lm_load

from mlxcache_kernel.engine import Engine, SamplingParams

MODES = {"greedy": SamplingParams(max_tokens=40), "seeded": SamplingParams(max_tokens=40, temperature=0.8, seed=3)}


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "m", seed=1)  # the same tokenizer: rejects often


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_cache_kind_rolls_back_exactly(arch, llama_draft, tmp_path):
    target = build_arch_model(arch, tmp_path / "target")
    twin = build_arch_model(arch, tmp_path / "twin", seed=5)  # a draft with this arch's own cache kinds
    prompt = ids(WINDOW - 3, 1)  # the window wraps during the first verifications
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(target, name="m")
        eng.load_model(twin, name="twin")
        eng.load_model(llama_draft, name="llama")
        for mode, params in MODES.items():
            expected = eng.generate_tokens(prompt, params=params, model="m", use_cache=False).tokens
            assert len(expected) >= 8, f"{arch} {mode}: eos after {len(expected)} tokens"
            for draft in ("twin", "llama", "m"):
                for run in ("cold", "cached"):
                    r = eng.generate_tokens(prompt, params=params, model="m", draft=draft, num_draft_tokens=4)
                    assert r.tokens == expected, (arch, mode, draft, run)
                    s = r.stats
                    assert s["draft_fallback"] is None and s["draft_tokens_proposed"] > 0, (arch, draft, s)
                    if draft != "m":
                        assert s["draft_tokens_accepted"] < s["draft_tokens_proposed"], (arch, draft)  # rejections
                    if run == "cached" and draft != "m":
                        assert s["draft_cached_tokens"] > 0, (arch, draft, s)
            eng.flush(timeout=60)
            eng.cache_clear(ssd=True)


def test_a_window_the_verify_step_wraps_is_exact_where_mlx_lm_trims_nothing(llama_draft, tmp_path):
    path = build_arch_model("gemma3_text", tmp_path / "gemma")
    prompt = ids(WINDOW - 2, 2)  # not wrapped at the start: mlx-lm's one trimmability check passes
    model, _ = lm_load(str(path))
    caches = lm_cache.make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=caches)
    assert lm_cache.can_trim_prompt_cache(caches)
    model(mx.array(ids(5, 3))[None], cache=caches)  # one verify forward of 4 drafts + 1
    assert not lm_cache.can_trim_prompt_cache(caches) and lm_cache.trim_prompt_cache(caches, 4) == 0
    assert any(c.offset > 0 for c in caches if type(c).__name__ == "KVCache")  # ... and it left these untrimmed
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(path, name="g")
        eng.load_model(llama_draft, name="llama")
        for params in MODES.values():
            expected = eng.generate_tokens(prompt, params=params, model="g", use_cache=False).tokens
            for k in (2, 4, 6):
                r = eng.generate_tokens(prompt, params=params, model="g", draft="llama", num_draft_tokens=k,
                                        use_cache=False)
                assert r.tokens == expected, k
                assert r.stats["draft_fallback"] is None
                assert r.stats["draft_tokens_accepted"] < r.stats["draft_tokens_proposed"]  # rejections: rollbacks
