"""LoRA adapters in mlx-lm's format (tests/support/tiny_adapter.py): the base model and each adapter
keep caches of their own, never serve each other's prefixes, and each is exact against
its own cold run, across switches and restarts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_adapter import build_adapter
from tiny_model import build_tiny_model

from mlxcache_kernel.engine import Engine, ModelError, SamplingParams


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


PROMPT = ids(80, 1)
LONGER = PROMPT + ids(6, 2)  # extends PROMPT: served from its own model's cache only
PROMPTS = {"prompt": PROMPT, "longer": LONGER}
PARAMS = SamplingParams(max_tokens=10, temperature=0.7, seed=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(d / "base")
    return base, {"base": None, "a": build_adapter(base, d / "a", seed=1), "b": build_adapter(base, d / "b", seed=2)}


@pytest.fixture(scope="module")
def cold(models, tmp_path_factory):
    base, adapters = models
    with Engine(cache_dir=tmp_path_factory.mktemp("ref"), ssd=False) as ref:
        for name, adapter in adapters.items():
            ref.load_model(base, name=name, adapter_path=adapter)
        return {(name, k): ref.generate_tokens(p, params=PARAMS, model=name, use_cache=False).tokens
                for name in adapters for k, p in PROMPTS.items()}


def test_each_adapter_has_its_own_namespace_and_cache(models, cold, tmp_path):
    base, adapters = models
    assert len({tuple(cold[(name, "prompt")]) for name in adapters}) == 3  # the adapters change the output
    cache = tmp_path / "c"
    with Engine(cache_dir=cache, prefetch_budget_bytes=0) as eng:
        infos = {name: eng.load_model(base, name=name, adapter_path=adapter) for name, adapter in adapters.items()}
        assert len({i["namespace"] for i in infos.values()}) == 3
        assert "adapter" not in infos["base"]["identity"] and infos["base"]["adapter"] is None
        assert infos["a"]["adapter"] == str(adapters["a"].resolve())
        assert set(infos["a"]["identity"]["adapter"]) == {"weights", "config"}
        for name in adapters:  # the same prompt under each: nobody serves another's prefix
            r = eng.generate_tokens(PROMPT, params=PARAMS, model=name)
            assert r.stats["cached_tokens"] == 0 and r.tokens == cold[(name, "prompt")], name
        for name in adapters:
            r = eng.generate_tokens(LONGER, params=PARAMS, model=name)
            assert r.stats["cache_source"] == "ram" and r.stats["cached_tokens"] >= len(PROMPT) - 1, name
            assert r.tokens == cold[(name, "longer")], name
        rs = eng.generate_batch([PROMPT, LONGER], max_tokens=6, model="a")
        assert [r.tokens for r in rs] == [r.tokens for r in eng.generate_batch([PROMPT, LONGER], max_tokens=6,
                                                                                 model="a", use_cache=False)]
        namespaces = {e["namespace"] for e in eng.admin.entries()}
        assert namespaces == {i["namespace"] for i in infos.values()}
        assert eng.flush(timeout=60)["pending"] == 0
    with Engine(cache_dir=cache, prefetch_budget_bytes=0) as eng:  # a restart, then switches under one name
        for name in ("b", "base", "a"):
            eng.load_model(base, name="m", adapter_path=adapters[name])
            r = eng.generate_tokens(LONGER, params=PARAMS, model="m")
            assert r.stats["cache_source"] == "ssd" and r.tokens == cold[(name, "longer")], name
            assert eng.models.info("m")["namespace"] == infos[name]["namespace"]


def test_bad_adapters_are_clear_errors(models, tmp_path):
    base, adapters = models
    wide = build_tiny_model(tmp_path / "wide", hidden=128)
    other = build_adapter(wide, tmp_path / "other")
    (tmp_path / "empty").mkdir()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapters.safetensors").write_bytes((adapters["a"] / "adapters.safetensors").read_bytes())
    (broken / "adapter_config.json").write_text("[1, 2]")
    with Engine(cache_dir=tmp_path / "c", ssd=False) as eng:
        for adapter, message in [(tmp_path / "nowhere", "adapter path is not a directory"),
                                 (tmp_path / "empty", "no adapter_config.json or adapters.safetensors"),
                                 (broken, "is not a JSON object"),
                                 (other, "could not apply the adapter")]:
            with pytest.raises(ModelError, match=message):
                eng.load_model(base, name="x", adapter_path=adapter)
        (broken / "adapter_config.json").write_text("{not json")
        with pytest.raises(ModelError, match="not readable JSON"):
            eng.load_model(base, name="x", adapter_path=broken)
        assert eng.models.names() == []
        config = json.loads((adapters["a"] / "adapter_config.json").read_text())
        assert config["fine_tune_type"] == "lora"  # mlx-lm's own format
