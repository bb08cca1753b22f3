"""One definition of every option (engine/config.py): the Engine's keywords, the environment and the
kernel's MLXCache settings are derived from it, and docs/configuration.md's table is generated from it."""

from __future__ import annotations

import dataclasses

import pytest
from repo_paths import ROOT

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.config import ConfigError, EngineConfig, RemoteConfigError, option_table, options
from mlxcache_kernel.settings import KERNEL_OPTIONS, MLXCache


def test_every_option_has_a_variable_a_setting_and_help():
    every = options()
    assert list(every) == [f.name for f in dataclasses.fields(EngineConfig)]
    envs = [o.env for o in every.values()] + [o.env for o in KERNEL_OPTIONS.values()]
    assert len(set(envs)) == len(envs) and all(e.startswith("MLXCACHE_") for e in envs)
    traits = MLXCache.class_trait_names(config=True)
    assert {o.setting for o in every.values()} | set(KERNEL_OPTIONS) <= set(traits)
    assert all(o.help and o.label for o in every.values())


def test_environment_then_keywords():
    env = {"MLXCACHE_RAM_BUDGET": "2GiB", "MLXCACHE_PREFETCH_BUDGET": "off", "MLXCACHE_SSD": "0",
           "MLXCACHE_IDLE_DEMOTE_S": "0", "MLXCACHE_RETENTION": "COST", "MLXCACHE_PREFILL_CHUNK": "64"}
    c = EngineConfig.from_env(env, prefill_chunk=128)
    assert (c.ram_budget_bytes, c.prefetch_budget_bytes, c.ssd, c.idle_demote_s) == (2 << 30, 0, False, None)
    assert c.retention == "cost" and c.prefill_chunk == 128  # the keyword wins
    assert EngineConfig.from_env({}) == EngineConfig()


def test_bad_values_name_the_option_its_variable_and_setting():
    with pytest.raises(ValueError, match=r"RAM budget \(MLXCACHE_RAM_BUDGET\).*plenty"):
        EngineConfig.from_env({"MLXCACHE_RAM_BUDGET": "plenty"})
    with pytest.raises(ConfigError, match="prefill chunk.*MLXCACHE_PREFILL_CHUNK.*MLXCache.prefill_chunk"):
        EngineConfig(prefill_chunk=0).check()
    with pytest.raises(ConfigError, match="low < high"):
        EngineConfig(memory_low_water=0.9, memory_high_water=0.8).check()
    with pytest.raises(ValueError, match="use one of lru, cost"):
        EngineConfig.from_env({"MLXCACHE_RETENTION": "fifo"})
    with pytest.raises(TypeError, match="unknown engine option.*ram_budget\\b"):
        EngineConfig().replace(ram_budget=1)


def test_a_secret_is_read_from_its_file_and_never_shown(tmp_path):
    (tmp_path / "s").write_text("a-team-secret-of-some-length\n")
    c = EngineConfig.from_env({"MLXCACHE_REMOTE_SECRET_FILE": str(tmp_path / "s")})
    assert c.remote_secret == "a-team-secret-of-some-length" and "team-secret" not in repr(c)
    with pytest.raises(RemoteConfigError, match="cannot read"):
        EngineConfig.from_env({"MLXCACHE_REMOTE_SECRET_FILE": str(tmp_path / "missing")})


def test_engine_keywords_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXCACHE_PREFILL_CHUNK", "96")
    monkeypatch.setenv("MLXCACHE_RETENTION", "cost")
    with Engine(cache_dir=tmp_path / "a", ssd=False) as eng:
        assert eng.prefill_chunk == 96 and eng.cache.retention.name == "cost" and not eng.cache.has_ssd
    with Engine(cache_dir=tmp_path / "b", prefill_chunk=32, retention="lru") as eng:
        assert eng.prefill_chunk == 32 and eng.cache.retention.name == "lru"
    with Engine(config=EngineConfig(cache_dir=str(tmp_path / "c"))) as eng:  # a config: no environment
        assert eng.prefill_chunk == 512
    with pytest.raises(TypeError, match="unknown engine option"):
        Engine(cache_dir=tmp_path / "d", prefil_chunk=3)


def test_the_kernel_settings_give_the_same_config(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCACHE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MLXCACHE_MEMORY_HIGH_WATER", "0.9")
    monkeypatch.setenv("MLXCACHE_RETENTION", "cost")
    s = MLXCache()
    assert s.memory_high_water == 0.9 and s.retention == "cost"
    s.prefill_chunk = 64
    c = s.engine_config()
    assert (c.cache_dir, c.memory_high_water, c.retention, c.prefill_chunk) == (str(tmp_path), 0.9, "cost", 64)


def test_the_configuration_page_table_is_generated_from_the_definition():
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("<!-- options:", 1)[1].split("\n", 1)[1].split("<!-- /options -->", 1)[0].strip()
    assert table == option_table(KERNEL_OPTIONS), (
        "docs/configuration.md's options table is stale: run python scripts/docs_tables.py")
