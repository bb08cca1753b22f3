"""The magics in an in-process IPython shell, on the tiny random model."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
from magics_shell import GEN, engine, run, usage_error
from tiny_model import build_tiny_model

from mlxcache_kernel.magics import CellResult, interpolate
from mlxcache_kernel.engine.host.system import physical_memory
from mlxcache_kernel.settings import MLXCache, parse_bool, parse_size


# --- settings ---


def test_parse_size_units():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MB") == 512_000_000
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("1048576") == 1 << 20
    assert parse_size(4096) == 4096
    assert parse_size("1.5k") == 1500
    assert parse_size("none", allow_none=True) is None
    if physical_memory():
        assert parse_size("50%") == physical_memory() // 2
    for bad in ("lots", "12 parsecs", "-1", "150%", "0%"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_size("none")
    assert parse_bool("1") and not parse_bool("0") and parse_bool("true")
    with pytest.raises(ValueError):
        parse_bool("maybe")


def test_settings_from_env_and_config(monkeypatch, tmp_path):
    from traitlets.config import Config

    monkeypatch.setenv("MLXCACHE_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("MLXCACHE_RAM_BUDGET", "2GiB")
    monkeypatch.setenv("MLXCACHE_SSD_BUDGET", "10GB")
    monkeypatch.setenv("MLXCACHE_WRITE_BEHIND", "0")
    monkeypatch.setenv("MLXCACHE_PREFILL_CHUNK", "256")
    monkeypatch.setenv("MLXCACHE_DEFAULT_MODEL", "none")
    monkeypatch.setenv("MLXCACHE_IDLE_DEMOTE_S", "600")
    s = MLXCache()
    kw = s.engine_kwargs()
    assert kw["idle_demote_s"] == 600.0
    assert kw["cache_dir"] == str(tmp_path / "c")
    assert kw["ram_budget_bytes"] == 2 << 30
    assert kw["ssd_budget_bytes"] == 10 * 1000**3
    assert kw["write_behind"] is False and kw["ssd"] is True
    assert kw["prefill_chunk"] == 256
    assert s.default_model_spec() is None
    # IPython config wins over the environment
    cfg = Config()
    cfg.MLXCache.ram_budget = "512MiB"
    cfg.MLXCache.default_model = "smollm2"
    s2 = MLXCache(config=cfg)
    assert s2.ram_budget_bytes() == 512 << 20
    assert s2.default_model_spec() == "smollm2"
    # defaults
    for var in ("MLXCACHE_CACHE_DIR", "MLXCACHE_RAM_BUDGET", "MLXCACHE_SSD_BUDGET", "MLXCACHE_WRITE_BEHIND",
                "MLXCACHE_PREFILL_CHUNK", "MLXCACHE_DEFAULT_MODEL"):
        monkeypatch.delenv(var)
    d = MLXCache()
    assert d.cache_dir.endswith("mlxcache-kernel")
    assert d.ssd_budget_bytes() is None and d.write_behind is True
    assert d.default_model_spec() == "smollm2"
    assert d.ram_budget == "auto" and d.ram_budget_bytes() is None  # adapts to the machine's memory
    if physical_memory():
        monkeypatch.setenv("MLXCACHE_RAM_BUDGET", "25%")
        assert 0 < MLXCache().ram_budget_bytes() <= physical_memory() // 2


def test_bad_setting_is_one_usage_error(ip, capsys, monkeypatch):
    monkeypatch.setenv("MLXCACHE_RAM_BUDGET", "plenty")
    import mlxcache_kernel

    mlxcache_kernel.unload_ipython_extension(ip)
    ip.extension_manager.loaded.discard("mlxcache_kernel")
    ip.run_line_magic("load_ext", "mlxcache_kernel")
    msg = usage_error(ip, capsys, "%cache stats")
    assert "RAM budget" in msg and "plenty" in msg
    # %config fixes it before the engine exists
    run(ip, capsys, "%config MLXCache.ram_budget = '64MiB'")
    res, out, _ = run(ip, capsys, "%cache stats")
    assert res.success and "64.0 MiB" in out and str(64 << 20) not in out  # bytes one way, readable


# --- interpolation ---


def test_interpolation_rules():
    import json as json_module

    ns = {"doc": "the text", "n": 3, "json": json_module, "f": len, "_private": "x", "In": ["hidden"]}
    hidden = {"In"}
    assert interpolate("Read {doc} ({n} times)", ns, hidden) == "Read the text (3 times)"
    assert interpolate("{missing} stays", ns, hidden) == "{missing} stays"
    assert interpolate('{"a": {doc}}', ns, hidden) == '{"a": the text}'
    assert interpolate('{"key": 1, "x": [1, {2}]}', ns, hidden) == '{"key": 1, "x": [1, {2}]}'
    assert interpolate("escape {{doc}}", ns, hidden) == "escape {doc}"
    assert interpolate("jinja {{ doc }} and {{undefined}}", ns, hidden) == "jinja {{ doc }} and {undefined}"
    assert interpolate("{json} {f} {_private} {In}", ns, hidden) == "{json} {f} {_private} {In}"
    assert interpolate("code { x = 1; } {doc.attr}", ns, hidden) == "code { x = 1; } {doc.attr}"


# --- %model ---


def test_model_load_list_use_unload(ip, capsys, tmp_path):
    from tiny_model import build_tiny_model

    path = ip.tiny_model_dir
    wide = build_tiny_model(tmp_path / "wide", hidden=128)  # head_dim 32: KV quantizes in groups of 32
    res, out, _ = run(ip, capsys, f"%model load {path}")
    assert res.success and "loaded 'default' (default)" in out and "2 layers" in out
    res, out, _ = run(ip, capsys, f"%model load {path} --name second")
    assert res.success and "loaded 'second'" in out
    res, out, _ = run(ip, capsys, "%model list")
    assert res.success
    lines = out.splitlines()
    assert any(ln.startswith("*") and "default" in ln for ln in lines)
    assert any("second" in ln and not ln.startswith("*") for ln in lines)
    res, out, _ = run(ip, capsys, "%model use second")
    assert res.success and engine(ip).models.default == "second"
    res, out, _ = run(ip, capsys, "%model info second")
    assert "namespace" in out and "identity.artifact" in out
    res, out, _ = run(ip, capsys, f"%model load {wide} --name q8 --kv-bits 8 --kv-group-size 32 --kv-start 0")
    assert res.success and "QuantizedKVCache:float32:q8g32" in out
    res, out, _ = run(ip, capsys, f"%model load {wide} --name q8late --kv-bits 8 --kv-group-size 32 --kv-start 40")
    assert res.success and "KVCache:float32:q8g32@40" in out and engine(ip).models.get("q8late").kv_start == 40
    assert "(8-bit KV (groups of 32) from token 40)" in out  # the setting in words
    run(ip, capsys, "%model unload q8late")
    assert "does not fit this model's KV" in usage_error(ip, capsys, f"%model load {path} --name bad --kv-bits 8")
    assert engine(ip).models.info("q8")["namespace"] != engine(ip).models.info("second")["namespace"]
    run(ip, capsys, "%model unload q8")
    res, out, _ = run(ip, capsys, "%model unload default")
    assert res.success and engine(ip).models.names() == ["second"]
    res, _, _ = run(ip, capsys, f"{GEN} --model second\nhello")
    assert res.success and isinstance(res.result, CellResult)


def test_model_errors(ip, capsys, tmp_path):
    assert "invalid choice" in usage_error(ip, capsys, "%model bogus")
    assert "does not exist" in usage_error(ip, capsys, f"%model load {tmp_path}/nowhere")
    (tmp_path / "empty").mkdir()
    assert "config.json" in usage_error(ip, capsys, f"%model load {tmp_path}/empty")
    assert "unknown model 'ghost'" in usage_error(ip, capsys, "%model use ghost")
    assert "unknown model 'ghost'" in usage_error(ip, capsys, "%model unload ghost")
    assert "needs a model name" in usage_error(ip, capsys, "%model use")
    assert "--name, --kv-bits, --kv-start, --adapter, --draft and --chat-template only apply" in usage_error(ip, capsys, "%model list --name x")
    assert "--name, --kv-bits, --kv-start, --adapter, --draft and --chat-template only apply" in usage_error(ip, capsys, "%model info --kv-bits 8")
    assert "invalid choice" in usage_error(ip, capsys, f"%model load {ip.tiny_model_dir} --kv-bits 3")
    assert "needs kv_bits" in usage_error(ip, capsys, f"%model load {ip.tiny_model_dir} --name k --kv-start 40")
    assert ">= 0" in usage_error(ip, capsys, f"%model load {ip.tiny_model_dir} --name k --kv-bits 8 --kv-start -1")
    assert "unrecognized" in usage_error(ip, capsys, "%model list --bogus")
    assert "takes no name" in usage_error(ip, capsys, "%model list extra")
    assert "takes no name" in usage_error(ip, capsys, "%session list extra")
    assert "cannot parse" in usage_error(ip, capsys, "%session new 'unbalanced")
    assert "invalid model name" in usage_error(ip, capsys, f"%model load {ip.tiny_model_dir} --name 'a b'")
    # the engine keeps working
    res, _, _ = run(ip, capsys, f"{GEN}\nstill fine")
    assert res.success


# --- %%generate ---


def test_generate_streams_and_returns(ip, capsys):
    ip.user_ns["doc"] = "a short document"
    res, out, err = run(ip, capsys, GEN + " --out g\nSummarize: {doc}")
    assert res.success, err
    g = ip.user_ns["g"]
    assert res.result is g and isinstance(g, CellResult)
    assert g.prompt == "Summarize: a short document"
    assert len(g.tokens) == 8 and g.stats["decode_tokens"] == 8
    assert g.text and g.text in out  # streamed into the cell output
    assert str(g) == g.text
    footer = repr(g)
    assert "prompt tokens: 0 from RAM, 0 from SSD," in footer and "TTFT" in footer and "tok/s" in footer
    assert g.stats["prompt_tokens"] == g.stats["prefilled_tokens"]
    # the display of the returned object is the footer
    fmt = ip.display_formatter.format(g)[0]
    assert fmt["text/plain"] == footer and "TTFT" in g._repr_html_()

    res2, out2, _ = run(ip, capsys, GEN + " --out g2\nSummarize: {doc}")
    g2 = ip.user_ns["g2"]
    assert g2.text == g.text and g2.tokens == g.tokens
    assert g2.stats["cache_source"] == "ram"
    assert g2.stats["ram_tokens"] == g2.stats["prompt_tokens"] - 1
    assert f"{g2.stats['ram_tokens']} from RAM" in repr(g2)


def test_generate_sampling_seed_and_options(ip, capsys):
    cell = "%%generate --max-tokens 12 --temperature 1.0 --top-p 0.95 --seed {seed} --no-cache\nTell me a story"
    a = run(ip, capsys, cell.format(seed=7))[0].result
    b = run(ip, capsys, cell.format(seed=7))[0].result
    c = run(ip, capsys, cell.format(seed=8))[0].result
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    assert "cache off" in repr(a) and a.stats["cached_tokens"] == 0
    # seeded output after a cache hit equals the cold run
    run(ip, capsys, "%%generate --max-tokens 12 --temperature 1.0 --seed 7\nTell me a story")
    d = run(ip, capsys, "%%generate --max-tokens 12 --temperature 1.0 --top-p 0.95 --seed 7\nTell me a story")[0].result
    assert d.stats["cache_source"] == "ram" and d.tokens == a.tokens
    # --system and --raw change the prompt; --stop and --top-k are accepted
    base = run(ip, capsys, f"{GEN}\nhi")[0].result
    sys_ = run(ip, capsys, f'{GEN} --system "You are terse."\nhi')[0].result
    raw = run(ip, capsys, f"{GEN} --raw\nhi")[0].result
    assert sys_.stats["prompt_tokens"] > base.stats["prompt_tokens"] > raw.stats["prompt_tokens"] == 2
    topk = run(ip, capsys, "%%generate --max-tokens 4 -t 0.7 --top-k 5 --stop zz\nhi")[0]
    assert topk.success
    lit = run(ip, capsys, "%%generate --max-tokens 2 --literal --out g\n{doc}")[0]
    assert lit.success and ip.user_ns["g"].prompt == "{doc}"


def test_generate_errors(ip, capsys):
    from IPython.core.error import UsageError

    assert "empty prompt" in usage_error(ip, capsys, "%%generate\n   \n\n")
    assert "max_tokens" in usage_error(ip, capsys, "%%generate --max-tokens 0\nhi")
    assert "temperature" in usage_error(ip, capsys, "%%generate --temperature -1\nhi")
    assert "top_p" in usage_error(ip, capsys, "%%generate --top-p 2\nhi")
    assert "seed" in usage_error(ip, capsys, "%%generate --seed -3\nhi")
    assert "invalid int" in usage_error(ip, capsys, "%%generate --max-tokens many\nhi")
    assert "unknown model 'ghost'" in usage_error(ip, capsys, "%%generate --model ghost\nhi")
    assert "unrecognized" in usage_error(ip, capsys, "%%generate --colour blue\nhi")
    assert "variable name" in usage_error(ip, capsys, "%%generate --out 1x\nhi")
    assert "checkpoint-every" in usage_error(ip, capsys, "%%generate --checkpoint-every 0\nhi")
    assert "invalid session id" in usage_error(ip, capsys, "%%generate --session 'bad id'\nhi")
    # nothing lost: the cache still answers from RAM after the errors
    first = run(ip, capsys, f"{GEN}\nremember me")[0].result
    for bad in ("%%generate --top-p 0\nremember me", "%%generate --model nope\nremember me"):
        usage_error(ip, capsys, bad)
    again = run(ip, capsys, f"{GEN}\nremember me")[0].result
    assert again.stats["cache_source"] == "ram" and again.tokens == first.tokens
    assert isinstance(ip.run_cell("%%generate --max-tokens 0\nhi").error_in_exec, UsageError)


def test_no_model_loaded(ip, capsys, monkeypatch):
    import mlxcache_kernel

    monkeypatch.setenv("MLXCACHE_DEFAULT_MODEL", "none")
    mlxcache_kernel.unload_ipython_extension(ip)
    ip.extension_manager.loaded.discard("mlxcache_kernel")
    ip.run_line_magic("load_ext", "mlxcache_kernel")
    assert "no model is loaded" in usage_error(ip, capsys, f"{GEN}\nhi")
    assert "needs a path" in usage_error(ip, capsys, "%model load")
    run(ip, capsys, f"%model load {ip.tiny_model_dir}")
    assert run(ip, capsys, f"{GEN}\nhi")[0].success


def test_model_load_without_path_loads_the_configured_default(ip, capsys):
    res, out, _ = run(ip, capsys, "%model load")
    assert res.success and str(ip.tiny_model_dir) in out
    assert engine(ip).models.names() == ["default"]


def test_default_model_loads_lazily(ip, capsys):
    assert engine(ip).models.names() == []
    res, out, _ = run(ip, capsys, f"{GEN}\nhi")
    assert res.success and "loading the default model" in out
    assert engine(ip).models.names() == ["default"]


def test_help_texts(ip):
    doc = ip.find_cell_magic("generate").__doc__
    for opt in ("--max-tokens", "--temperature", "--top-p", "--seed", "--session", "--system", "--raw",
                "--out", "--checkpoint-every", "--no-cache", "--model"):
        assert opt in doc, opt
    info = ip.object_inspect_text("%%generate")
    assert "--checkpoint-every" in info and "interpolat" in info.lower() or "{name}" in info
    for name in ("model", "session", "checkpoint", "cache", "kv"):
        assert f"%{name} [" in ip.find_line_magic(name).__doc__


def test_interrupt_keeps_engine_usable(ip, capsys):
    """A KeyboardInterrupt mid-generation (as SIGINT would raise) leaves the engine working."""
    eng = engine(ip)
    original = eng.generate

    def interrupted(*args, on_text=None, **kwargs):
        calls = []

        def boom(piece):
            calls.append(piece)
            if len(calls) == 3:
                raise KeyboardInterrupt
            on_text(piece)

        return original(*args, on_text=boom, **kwargs)

    eng.generate = interrupted
    try:
        res, out, err = run(ip, capsys, f"{GEN}\nhello")
    finally:
        eng.generate = original
    assert isinstance(res.error_in_exec, KeyboardInterrupt)
    assert "interrupted" in err
    res, _, _ = run(ip, capsys, f"{GEN}\nhello")
    assert res.success and res.result.stats["cache_source"] == "ram"


# --- %session ---


def test_sessions(ip, capsys):
    res, out, _ = run(ip, capsys, '%session new chat --system "Be brief."')
    assert res.success and "'chat' created" in out
    t1 = run(ip, capsys, f"{GEN} --session chat\nFirst question")[0].result
    t2 = run(ip, capsys, f"{GEN} --session chat\nSecond question")[0].result
    assert t2.stats["prompt_tokens"] > t1.stats["prompt_tokens"]
    assert t2.stats["cached_tokens"] >= t1.stats["prompt_tokens"]  # the whole first turn came from the cache
    assert "session chat" in repr(t2)
    res, out, _ = run(ip, capsys, "%session list")
    assert "chat" in out and " 2 " in out
    res, out, _ = run(ip, capsys, "%session show chat")
    assert "[system] Be brief." in out and "[user] First question" in out and "[user] Second question" in out
    assert f"[assistant] {t1.text}" in out
    res, out, _ = run(ip, capsys, "%session reset chat")
    assert res.success and engine(ip).sessions.get("chat").turns == 0
    res, out, _ = run(ip, capsys, "%session close chat")
    assert res.success and "chat" not in engine(ip).sessions
    # closing keeps the cached state: the same conversation start is still a hit
    again = run(ip, capsys, f'{GEN} --system "Be brief."\nFirst question')[0].result
    assert again.stats["cached_tokens"] > 0


def test_session_switch_loads_its_state_in_the_background(ip, capsys):
    t1 = run(ip, capsys, f"{GEN} --session chat\nFirst question")[0].result
    res, out, _ = run(ip, capsys, "%session switch chat")
    assert res.success and "'chat': its state is in RAM" in out
    run(ip, capsys, "%cache clear")  # flushes first: the state is on SSD only
    res, out, _ = run(ip, capsys, "%session switch chat")
    assert res.success and "loading its state from SSD in the background" in out
    t2 = run(ip, capsys, f"{GEN} --session chat\nSecond question")[0].result
    assert t2.stats["cached_tokens"] >= t1.stats["prompt_tokens"]
    assert engine(ip).stats()["ssd_restores"] == 1  # one read, shared with the generation if need be
    assert "unknown session 'nope'" in usage_error(ip, capsys, "%session switch nope")
    res, out, _ = run(ip, capsys, "%cache config")
    assert "prefetch_budget: auto" in out and "prefetch_budget_bytes: None" in out


def test_session_errors(ip, capsys):
    assert "needs a session id" in usage_error(ip, capsys, "%session show")
    assert "unknown session 'nope'" in usage_error(ip, capsys, "%session show nope")
    assert "unknown session 'nope'" in usage_error(ip, capsys, "%session reset nope")
    assert "invalid session id" in usage_error(ip, capsys, "%session new 'a b'")
    run(ip, capsys, "%session new dup")
    assert "already exists" in usage_error(ip, capsys, "%session new dup")
    assert "only apply to %session new" in usage_error(ip, capsys, "%session list --system x")
    assert "invalid choice" in usage_error(ip, capsys, "%session open x")
    assert "unknown model" in usage_error(ip, capsys, "%session new other --model ghost")
    assert "unknown session 'nope'" in usage_error(ip, capsys, "%session close nope")


# --- %cache ---


def test_cache_stats_are_grouped_and_all_shows_every_counter(ip, capsys):
    run(ip, capsys, f"{GEN}\nfill the cache")
    run(ip, capsys, "%cache flush")
    stats = engine(ip).stats()
    out = run(ip, capsys, "%cache stats")[1]
    heads = [line[:-1] for line in out.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert heads[:4] == ["engine", "RAM", "SSD", "writes"], heads
    assert "remote" not in heads and "vision" not in heads  # nothing there yet
    assert "remote, objects, vision: nothing yet" in out and "zero counters" in out and "--all" in out
    assert "  remote_hits" not in out, out
    assert "  ram_entries" in out and "  ssd_files" in out, out
    every = run(ip, capsys, "%cache stats --all")[1]
    keys = [line.split()[0] for line in every.splitlines() if line.startswith("  ")]
    assert sorted(keys) == sorted(stats) and len(keys) == len(stats)  # complete, each key once
    assert [h[:-1] for h in every.splitlines() if h.endswith(":") and not h.startswith(" ")] == [
        "engine", "RAM", "SSD", "writes", "remote", "objects", "vision"]
    assert len(out.splitlines()) < len(every.splitlines())


def test_cache_stats_ls_flush_clear(ip, capsys):
    run(ip, capsys, f"{GEN}\nfill the cache")
    res, out, _ = run(ip, capsys, "%cache stats")
    assert res.success and "ram_entries" in out and "ram_budget_bytes" in out and "256.0 MiB" in out
    res, out, _ = run(ip, capsys, "%cache flush")
    assert res.success and "flushed:" in out and "0 failed" in out
    assert engine(ip).stats()["pending_writes"] == 0 and engine(ip).stats()["ssd_files"] >= 1
    res, out, _ = run(ip, capsys, "%cache config")
    assert "ram_budget: 256MiB" in out and "cache_dir:" in out
    res, out, _ = run(ip, capsys, "%cache ls")
    assert res.success and "ram" in out and "committed" in out
    # the entry's bytes are named apart: its own in RAM, shared with others, KV state, SSD file; the totals once
    assert out.splitlines()[0].split()[:8] == ["model", "tokens", "tier", "write_state", "ram", "shared", "kv", "file"]
    assert re.search(r"^RAM holds [\d.]+ \w*B in all .*; SSD [\d.]+ \w*B unique", out, re.M), out
    res, out, _ = run(ip, capsys, "%cache clear")
    assert res.success and "SSD files kept" in out and engine(ip).stats()["ram_entries"] == 0
    res, out, _ = run(ip, capsys, "%cache ls")
    row = out.splitlines()[2].split()
    assert row[2] == "ssd" and row[4] == "–" and row[5] == "–", out  # not in RAM
    assert re.fullmatch(r"[\d.]+ \w*B [\d.]+ \w*B", " ".join(row[6:10])), out  # kv and file sizes
    again = run(ip, capsys, f"{GEN}\nfill the cache")[0].result
    assert again.stats["cache_source"] == "ssd" and "from SSD" in repr(again)
    run(ip, capsys, "%cache flush")
    res, out, _ = run(ip, capsys, "%cache clear --ssd")
    assert res.success and engine(ip).stats()["ssd_files"] == 0


def test_cache_verify_and_gc(ip, capsys):
    run(ip, capsys, f"{GEN}\nsomething to persist")
    run(ip, capsys, "%cache flush")
    res, out, _ = run(ip, capsys, "%cache verify")
    assert res.success and "intact" in out
    files = list(Path(engine(ip).cache_dir).rglob("*.blk"))  # the KV lives in shared blocks
    assert files
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    res, out, _ = run(ip, capsys, "%cache verify")
    assert res.success and "1 bad file" in out
    res, out, _ = run(ip, capsys, "%cache gc --dry-run")
    assert res.success and out.startswith("gc (dry run):") and "quarantine" in out
    assert list((Path(engine(ip).cache_dir) / "checkpoints" / "quarantine").iterdir())
    res, out, _ = run(ip, capsys, "%cache gc")  # the evidence stays
    assert res.success and out.startswith("gc:") and "kept 1 quarantined file(s) as evidence" in out
    assert list((Path(engine(ip).cache_dir) / "checkpoints" / "quarantine").iterdir())
    res, out, _ = run(ip, capsys, "%cache gc --quarantine")
    assert res.success and out.startswith("gc:") and "removed 1 quarantined file" in out
    assert not list((Path(engine(ip).cache_dir) / "checkpoints" / "quarantine").iterdir())
    assert "only apply to %cache gc" in usage_error(ip, capsys, "%cache stats --quarantine")


def test_cache_errors(ip, capsys):
    assert "--ssd only applies" in usage_error(ip, capsys, "%cache stats --ssd")
    assert "--timeout only applies" in usage_error(ip, capsys, "%cache ls --timeout 3")
    assert "invalid choice" in usage_error(ip, capsys, "%cache wipe")


# --- %checkpoint ---


def test_checkpoints(ip, capsys):
    first = run(ip, capsys, f"{GEN} --session s1\nA question worth keeping")[0].result
    res, out, _ = run(ip, capsys, "%checkpoint save keep --session s1")
    assert res.success and "'keep' saved" in out
    assert re.search(r"\(\d+ tokens, [\d.]+ \w+ KV, session 's1'\)", out), out
    res, out, _ = run(ip, capsys, "%checkpoint list")
    assert "keep" in out and "kv_bytes" in out
    # named checkpoints survive a full RAM clear and budget pressure
    run(ip, capsys, "%cache clear")
    res, out, _ = run(ip, capsys, "%checkpoint restore keep")
    assert res.success and "'keep' loading from SSD in the background" in out
    res, out, _ = run(ip, capsys, "%checkpoint rm keep")
    assert res.success
    res, out, _ = run(ip, capsys, "%checkpoint list")
    assert "keep" not in out
    assert first.text


def test_checkpoint_errors(ip, capsys):
    assert "needs a name" in usage_error(ip, capsys, "%checkpoint save")
    assert "only apply to %checkpoint save" in usage_error(ip, capsys, "%checkpoint list --session x")
    usage_error(ip, capsys, "%checkpoint restore nothing-here")
    usage_error(ip, capsys, "%checkpoint rm nothing-here")
    usage_error(ip, capsys, "%checkpoint save 'bad/name'")
    usage_error(ip, capsys, "%checkpoint save x --session ghost")


# --- %kv ---


def test_kv_inspect_and_export(ip, capsys):
    run(ip, capsys, f"{GEN} --session s\nlook inside")
    res, out, _ = run(ip, capsys, "%kv inspect --last")
    assert res.success and "KVCache" in out
    res, out, _ = run(ip, capsys, "%kv inspect --session s --layer 1")
    assert res.success
    res, out, _ = run(ip, capsys, "%kv export --last --to kvs")
    assert res.success and "kvs = {" in out
    kvs = ip.user_ns["kvs"]
    assert kvs and all(isinstance(a, np.ndarray) for a in kvs.values())
    assert all(np.isfinite(a).all() for a in kvs.values())


def test_kv_errors(ip, capsys):
    assert "choose one of" in usage_error(ip, capsys, "%kv inspect --session a --last")
    assert "needs --to" in usage_error(ip, capsys, "%kv export --last")
    assert "--to only applies" in usage_error(ip, capsys, "%kv inspect --to x")
    assert "--layer must be" in usage_error(ip, capsys, "%kv inspect --layer -1")
    assert "variable name" in usage_error(ip, capsys, "%kv export --to 9x")
    usage_error(ip, capsys, "%kv inspect --session nope")
    run(ip, capsys, GEN + "\nx")
    usage_error(ip, capsys, "%kv inspect --layer 99")


# --- widgets ---


def test_dashboard_and_inspector_widgets(ip, capsys):
    res, _, _ = run(ip, capsys, "%dashboard")
    assert res.success, res.error_in_exec
    assert "takes no arguments" in usage_error(ip, capsys, "%dashboard now")
    res, _, _ = run(ip, capsys, "%kv inspect --widget")
    assert res.success, res.error_in_exec


def test_progress_display_in_kernel_falls_back_to_text(monkeypatch):
    """Where the widget cannot be shown, the progress display is the widgets'
    TextProgress line in one plain-text output, updated in place."""
    from mlxcache_kernel.magics import output

    shown = []

    class Handle:
        def update(self, obj, raw=False):
            shown.append(obj)

    def no_widget(*args, **kwargs):
        raise RuntimeError("no widget front end")

    monkeypatch.setattr(output, "display", lambda *a, **k: (shown.append(a[0]), Handle())[1])
    monkeypatch.setattr(output, "GenerationProgress", no_widget)
    p = output.Progress(enabled=True)
    p("prefill", 100, 100)  # finished before anything was shown: no display
    assert shown == []
    p("prefill", 512, 2000)
    p("prefill", 2000, 2000)
    p.close()
    texts = [s.get("text/plain") for s in shown if isinstance(s, dict)]
    assert any(t.startswith("Prefill: 512/2,000 tokens") for t in texts), texts
    assert any(t.startswith("Prefill: 2,000/2,000 tokens (100%)") for t in texts), texts
    assert texts[-1] == ""


# --- extension lifecycle ---


def test_unload_flushes_and_removes_magics(ip, capsys):
    import mlxcache_kernel

    run(ip, capsys, f"{GEN}\npersist me")
    eng = engine(ip)
    mlxcache_kernel.unload_ipython_extension(ip)
    assert ip.find_cell_magic("generate") is None
    st = eng.cache.stats()
    assert st["pending_writes"] == 0 and st["writes_committed"] >= 1
    ip.extension_manager.loaded.discard("mlxcache_kernel")
    ip.run_line_magic("load_ext", "mlxcache_kernel")
    again = run(ip, capsys, f"{GEN}\npersist me")[0].result
    assert again.stats["cache_source"] in ("ssd", "ram")  # read now, or prefetched when the model loaded
    assert again.stats["cached_tokens"] == again.stats["prompt_tokens"] - 1


def test_get_engine(ip):
    import mlxcache_kernel

    assert mlxcache_kernel.get_engine(ip) is ip.mlxcache.engine
    assert os.path.samefile(mlxcache_kernel.get_engine(ip).cache_dir, os.environ["MLXCACHE_CACHE_DIR"])


def test_kv_export_bfloat16(ip, capsys, tmp_path):
    """A bfloat16 model's KV state exports as float32 numpy arrays (numpy has no bfloat16)."""
    bf16 = build_tiny_model(tmp_path / "bf16", dtype="bfloat16")
    run(ip, capsys, f"%model load {bf16} --name bf16")
    res, _, _ = run(ip, capsys, f"{GEN} --model bf16\nhalf precision")
    assert res.success
    res, out, _ = run(ip, capsys, "%kv inspect --last")
    assert "bfloat16" in out
    run(ip, capsys, "%kv export --last --to kvs")
    kvs = ip.user_ns["kvs"]
    assert kvs and all(a.dtype == np.float32 and np.isfinite(a).all() for a in kvs.values())
    assert any(np.abs(a).max() > 0 for a in kvs.values())


def test_remote_settings_are_shown_without_credentials(monkeypatch, tmp_path):
    from mlxcache_kernel.settings import MLXCache

    monkeypatch.setenv("MLXCACHE_REMOTE_URL", "rediss://team:pa55-hunter2@cache.example:6380")
    monkeypatch.setenv("MLXCACHE_REMOTE_SECRET", "team-mac-secret-hunter2")
    s = MLXCache()
    shown = s.summary()
    assert shown["remote_url"] == "rediss://***@cache.example:6380" and shown["remote_secret"] == "set ($MLXCACHE_REMOTE_SECRET)"
    assert shown["remote_password"] == "in the URL" and shown["remote_insecure"] is False
    assert "hunter2" not in repr(shown) and shown["remote_publish"] == "all"
    assert s.remote_url == "rediss://cache.example:6380"  # what %config MLXCache.remote_url shows
    assert "hunter2" not in MLXCache.class_get_help(s)  # what %config MLXCache shows
    kw = s.engine_kwargs()
    assert kw["remote_url"] == "rediss://team:pa55-hunter2@cache.example:6380"
    assert kw["remote_secret"] == "team-mac-secret-hunter2" and kw["remote_insecure"] is False
    # from files: the secret and the password never need the environment
    monkeypatch.delenv("MLXCACHE_REMOTE_SECRET")
    monkeypatch.setenv("MLXCACHE_REMOTE_URL", "redis://cache.example")
    (tmp_path / "secret").write_text("file-mac-secret-hunter2\n")
    (tmp_path / "password").write_text("file-pw-hunter2")
    monkeypatch.setenv("MLXCACHE_REMOTE_SECRET_FILE", str(tmp_path / "secret"))
    monkeypatch.setenv("MLXCACHE_REMOTE_PASSWORD_FILE", str(tmp_path / "password"))
    f = MLXCache()
    kw = f.engine_kwargs()
    assert (kw["remote_secret"], kw["remote_password"]) == ("file-mac-secret-hunter2", "file-pw-hunter2")
    assert f.summary()["remote_secret"] == f"from {tmp_path / 'secret'}" and "hunter2" not in repr(f.summary())
    with pytest.warns(UserWarning, match="saved with it"):  # a password typed into a notebook cell
        f.remote_url = "redis://u:typed-hunter2@h"
    assert f.remote_url == "redis://h" and f.engine_kwargs()["remote_url"] == "redis://u:typed-hunter2@h"
    monkeypatch.delenv("MLXCACHE_REMOTE_URL")
    assert MLXCache().summary()["remote_url"] == "off" and MLXCache().engine_kwargs()["remote_url"] is None
