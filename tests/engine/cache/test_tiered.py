"""RAM + SSD together: restart survival, bad files, failing writes, eviction,
named checkpoints and in-flight resume, on a tiny random model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from catalog_view import inflight_records
from holds import wait_ready

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.named.checkpoints import CheckpointNameError
from mlxcache_kernel.engine.cache.ssd import format as fmt
from repo_paths import SUPPORT

PROMPT = "A long shared document. " * 12 + "Question: what is it about?"


def ckpt_files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "checkpoints").glob("*/*.ckpt"), key=lambda p: p.stat().st_size)


def new_engine(cache_dir, model_dir, **kw) -> Engine:
    """An engine on `cache_dir` with the model loaded. No prefetch unless asked for: these
    tests are about what a lookup reads from SSD (test_prefetch.py covers prefetching)."""
    eng = Engine(cache_dir=cache_dir, **{"prefetch_budget_bytes": 0, **kw})
    eng.load_model(model_dir, name="tiny")
    return eng


@pytest.fixture
def cold_tokens(tiny_model_dir, tmp_path):
    eng = new_engine(tmp_path / "cold", tiny_model_dir, ssd=False)
    tokens = eng.generate(PROMPT, max_tokens=20, use_cache=False).tokens
    eng.close()
    return tokens


def test_restart_restores_longest_prefix_and_continues_like_cold(tiny_model_dir, tmp_path, cold_tokens):
    cache = tmp_path / "cache"
    eng = new_engine(cache, tiny_model_dir)
    first = eng.generate(PROMPT, max_tokens=20)
    report = eng.close()
    assert report["failed"] == [] and report["pending"] == 0
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in ckpt_files(cache))
    assert oct((cache / "checkpoints").stat().st_mode & 0o777) == "0o700"

    eng = new_engine(cache, tiny_model_dir)  # a restart
    again = eng.generate(PROMPT, max_tokens=20)
    assert again.stats["cache_source"] == "ssd"
    assert again.stats["cached_tokens"] == again.stats["prompt_tokens"] - 1
    assert again.tokens == first.tokens == cold_tokens
    # Published in RAM at once: the next identical request is a RAM hit.
    assert eng.generate(PROMPT, max_tokens=20).stats["cache_source"] == "ram"
    eng.close()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


CORRUPTIONS = {
    "truncated": lambda p: os.truncate(p, p.stat().st_size // 2),
    "flipped block byte": "blocks",  # the KV lives in shared blocks (format 2)
    "flipped header byte": lambda p: _flip(p, 200),
    "wrong magic": lambda p: _flip(p, 0),
}


def _write_at(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_newer_format_file_is_a_miss_left_alone(tiny_model_dir, tmp_path, cold_tokens):
    """A newer build sharing the directory keeps its files: not served, not quarantined, not deleted."""
    cache = tmp_path / "cache"
    eng = new_engine(cache, tiny_model_dir)
    eng.generate(PROMPT, max_tokens=20)
    eng.close()
    files = ckpt_files(cache)
    for path in files:
        _write_at(path, 8, struct.pack("<I", 99))
    eng = new_engine(cache, tiny_model_dir)
    r = eng.generate(PROMPT, max_tokens=20)
    assert r.stats["cache_source"] is None and r.tokens == cold_tokens
    assert eng.stats()["ssd_newer_format_files"] == len(files)
    eng.cache_clear(ssd=True)
    eng.cache_gc()
    eng.close()
    assert all(p.exists() for p in files) and not list((cache / "checkpoints" / "quarantine").iterdir())


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_bad_file_is_a_quarantined_miss(tiny_model_dir, tmp_path, cold_tokens, corruption):
    cache = tmp_path / "cache"
    eng = new_engine(cache, tiny_model_dir)
    eng.generate(PROMPT, max_tokens=20)
    eng.close()
    if CORRUPTIONS[corruption] == "blocks":
        for path in (cache / "checkpoints" / "blocks").glob("*.blk"):
            _flip(path, path.stat().st_size // 2)
    else:
        for path in ckpt_files(cache):
            CORRUPTIONS[corruption](path)

    eng = new_engine(cache, tiny_model_dir)
    events = []
    eng.events.subscribe(events.append)
    r = eng.generate(PROMPT, max_tokens=20)
    r2 = eng.generate(PROMPT, max_tokens=20)
    assert r.stats["cache_source"] is None
    assert r.tokens == cold_tokens == r2.tokens
    quarantined = list((cache / "checkpoints" / "quarantine").iterdir())
    assert quarantined, "bad files are moved aside"
    s = eng.stats()
    assert s["ssd_quarantined"] + s["ssd_restore_failures"] >= 1
    reported = [e for e in eng.events.recent if e["type"] == "quarantine"]
    assert len({e["path"] for e in reported}) == len(reported)  # each file reported once
    eng.close()


def test_other_model_identity_is_quarantined(tiny_model_dir, tmp_path, cold_tokens):
    cache = tmp_path / "cache"
    eng = new_engine(cache, tiny_model_dir)
    eng.generate(PROMPT, max_tokens=20)
    eng.close()
    # Rewrite each file's header so it claims other weights (header hash kept valid).
    for path in ckpt_files(cache):
        raw = bytearray(path.read_bytes())
        magic, version, capacity, length, _ = fmt._PREFIX.unpack_from(raw)
        body = json.loads(raw[fmt._PREFIX.size : fmt._PREFIX.size + length])
        body["identity"]["artifact"] = "0" * 64
        new = json.dumps(body, separators=(",", ":")).encode()
        assert len(new) <= capacity
        digest = fmt.hasher(version)
        digest.update(new)
        raw[: fmt._PREFIX.size] = fmt._PREFIX.pack(magic, version, capacity, len(new), digest.digest())
        raw[fmt._PREFIX.size : fmt._PREFIX.size + capacity] = new.ljust(capacity)
        path.write_bytes(bytes(raw))
    eng = new_engine(cache, tiny_model_dir)
    r = eng.generate(PROMPT, max_tokens=20)
    assert r.stats["cache_source"] is None and r.tokens == cold_tokens
    assert any(e["type"] == "quarantine" and "identity" in e["reason"] for e in eng.events.recent)
    eng.close()


def test_failed_write_keeps_entry_serving_and_retries(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    eng = new_engine(cache, tiny_model_dir)
    ns = eng.models.get().namespace
    blocker = cache / "checkpoints" / ns
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.write_text("a file where the namespace directory should be")  # stops root too
    eng.generate(PROMPT, max_tokens=8)
    report = eng.flush()
    assert report["failed"], "flush reports the failure"
    s = eng.stats()
    assert s["writes_failed"] >= 1 and s["failed_entries"] >= 1 and s["failed_bytes"] > 0
    hit = eng.generate(PROMPT, max_tokens=8)
    assert hit.stats["cache_source"] == "ram"  # still resident and serving
    assert {e.write_state for e in eng.cache.entries()} <= {"failed", "pending"}  # never dropped
    blocker.unlink()  # space returns
    report = eng.flush()
    assert report["failed"] == [] and report["committed"] >= 1
    assert ckpt_files(cache)
    eng.close()


def test_eviction_persists_before_demotion(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    eng = new_engine(cache, tiny_model_dir, ram_budget_bytes=300_000, write_behind=False)
    prompts = [f"Document {i}: " + "alpha beta gamma " * 6 for i in range(6)]
    results = [eng.generate(p, max_tokens=6) for p in prompts]
    eng.flush()
    s = eng.stats()
    assert s["demotions"] > 0 and s["writes_committed"] > 0
    assert s["ram_used_bytes"] <= 300_000
    assert all(e.write_state != "dirty" for e in eng.cache.entries())
    eng.close()
    eng = new_engine(cache, tiny_model_dir, ram_budget_bytes=300_000)
    for p, r in zip(prompts, results):
        again = eng.generate(p, max_tokens=6)
        assert again.stats["cache_source"] in ("ssd", "ram") and again.tokens == r.tokens
    eng.close()


def test_second_engine_sees_files_committed_after_it_started(tiny_model_dir, tmp_path, cold_tokens):
    cache = tmp_path / "cache"
    reader = new_engine(cache, tiny_model_dir)
    writer = new_engine(cache, tiny_model_dir)
    writer.generate(PROMPT, max_tokens=20)
    writer.flush()
    time.sleep(0.6)  # the miss-path rescan is throttled
    r = reader.generate(PROMPT, max_tokens=20)
    assert r.stats["cache_source"] == "ssd" and r.tokens == cold_tokens
    reader.close()
    writer.close()


def test_named_checkpoint_survives_restart_and_budgets(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    eng = new_engine(cache, tiny_model_dir)
    first = eng.generate("Hello, who are you?", max_tokens=8, session="chat", system="Be brief.")
    saved = eng.checkpoint_save("intro", session="chat")
    assert saved["tier"] == "ram+ssd" and saved["session"] == "chat"
    with pytest.raises(CheckpointNameError):
        eng.checkpoint_save("../escape")
    eng.close()

    eng = new_engine(cache, tiny_model_dir, ssd_budget_bytes=1)  # a cap that would evict everything else
    for i in range(3):
        eng.generate(f"unrelated {i} " * 10, max_tokens=4)
    eng.flush()
    assert [c["name"] for c in eng.checkpoint_list()] == ["intro"]
    info = eng.checkpoint_restore("intro")
    assert info["source"] == "loading"  # in the background
    assert eng.sessions.get("chat").turns == 1
    assert eng.cache.loading.wait_reads(30)
    nxt = eng.generate("And what can you do?", max_tokens=8, session="chat")
    # Random-model bytes may re-tokenize differently, so at least the first prompt is reused.
    assert nxt.stats["cache_source"] == "ram" and nxt.stats["cached_tokens"] >= first.stats["prompt_tokens"]
    eng.checkpoints.remove("intro")
    assert eng.checkpoint_list() == []
    with pytest.raises(CheckpointNameError, match="unknown checkpoint"):
        eng.checkpoint_restore("intro")
    eng.close()


def test_kv_inspect_and_export(tiny_model_dir, tmp_path):
    eng = new_engine(tmp_path / "c", tiny_model_dir)
    r = eng.generate(PROMPT, max_tokens=4)
    rows = eng.kv.info(last=True)
    n = r.stats["prompt_tokens"] + len(r.tokens) - 1
    assert {row["array"] for row in rows} == {"keys", "values"}
    assert all(row["shape"][2] == n and row["offset"] == n for row in rows)
    arrays = eng.kv.export(last=True, layer=1)
    assert sorted(arrays) == ["layer1.keys", "layer1.values"]
    assert arrays["layer1.keys"].shape == rows[2]["shape"]
    with pytest.raises(ValueError, match="out of range"):
        eng.kv.info(last=True, layer=99)
    eng.close()


RESUME_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from holds import hold_at_inflight
from mlxcache_kernel.engine import Engine
eng = Engine(cache_dir={cache!r})
eng.load_model({model!r}, name="tiny")
hold_at_inflight(eng, {cache!r}, 32, {ready!r})
eng.generate({prompt!r}, max_tokens=120, temperature=0.8, seed=11, checkpoint_every=16)
print("finished", flush=True)
"""


def test_kill_during_checkpointed_generation_resumes_exactly(tiny_model_dir, tmp_path):
    """The child holds (tests/support/holds.py) once a record of 32 tokens is durable; then SIGKILL."""
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ref = new_engine(tmp_path / "ref", tiny_model_dir, ssd=False)
    expected = ref.generate(PROMPT, max_tokens=120, temperature=0.8, seed=11, use_cache=False).tokens
    ref.close()
    assert len(expected) > 32, f"the run ends (eos) after {len(expected)} tokens, before the kill"
    script = RESUME_SCRIPT.format(tests=str(SUPPORT), cache=str(cache), model=str(tiny_model_dir),
                                  prompt=PROMPT, ready=str(ready))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        held = wait_ready(ready, lambda: None if proc.poll() is None else proc.communicate())
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    [record] = inflight_records(cache)
    assert len(record["emitted"]) == held["emitted"] == 32

    eng = new_engine(cache, tiny_model_dir)
    r = eng.generate(PROMPT, max_tokens=120, temperature=0.8, seed=11, checkpoint_every=16)
    assert r.stats["resumed_from"] == len(record["emitted"]) >= 32
    assert r.stats["cache_source"] == "ssd"
    assert r.tokens == expected
    assert not inflight_records(cache), "completion removes the resume record"
    again = eng.generate(PROMPT, max_tokens=120, temperature=0.8, seed=11)  # a new request, not a resume
    assert again.stats["resumed_from"] is None and again.tokens == expected
    eng.close()


def test_one_write_per_generation_when_the_final_state_covers_the_prompt(tiny_model_dir, tmp_path):
    eng = new_engine(tmp_path / "c", tiny_model_dir)
    r = eng.generate(PROMPT, max_tokens=6)
    eng.flush()
    s = eng.stats()
    assert s["writes_queued"] == s["writes_committed"] == 1
    [path] = ckpt_files(tmp_path / "c")
    assert len(fmt.read_header(path).tokens) == r.stats["prompt_tokens"] + len(r.tokens) - 1
    eng.close()


def test_ssd_restore_larger_than_the_ram_budget_serves_without_publishing(tiny_model_dir, tmp_path):
    prompt = "Prompt A: " + "the quick brown fox jumps over the lazy dog " * 18
    eng = new_engine(tmp_path / "c", tiny_model_dir, ram_budget_bytes=400_000, prefill_chunk=64)
    first = eng.generate(prompt, max_tokens=6)
    eng.flush()
    eng.cache.clear()  # RAM empty: the next lookup must go to SSD
    r = eng.generate(prompt, max_tokens=6)
    assert r.stats["cache_source"] == "ssd" and r.tokens == first.tokens
    assert eng.stats()["ram_used_bytes"] <= 400_000
    eng.close()


def test_idle_entries_are_demoted_once_durable(tiny_model_dir, tmp_path, cold_tokens):
    eng = new_engine(tmp_path / "c", tiny_model_dir, idle_demote_s=0.3)
    eng.generate(PROMPT, max_tokens=20)
    eng.poll()
    assert eng.cache.entries(), "fresh entries stay resident"
    eng.flush()
    time.sleep(0.4)
    eng.poll()  # the kernel polls between cells
    assert eng.cache.entries() == [] and eng.stats()["demotions"] >= 1
    assert any(e["type"] == "demote" and e["reason"] == "idle" for e in eng.events.recent)
    r = eng.generate(PROMPT, max_tokens=20)
    assert r.stats["cache_source"] == "ssd" and r.tokens == cold_tokens
    eng.close()


def test_clearing_ram_keeps_what_is_not_on_ssd(tiny_model_dir, tmp_path):
    cache = tmp_path / "cache"
    eng = new_engine(cache, tiny_model_dir)
    blocker = cache / "checkpoints" / eng.models.get().namespace
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.write_text("not a directory")
    eng.generate(PROMPT, max_tokens=6)
    report = eng.cache_clear()
    assert report["kept_not_durable"] == len(eng.cache.entries()) >= 1
    blocker.unlink()
    eng.flush()
    report = eng.cache_clear()
    assert report["kept_not_durable"] == 0 and eng.cache.entries() == []
    assert eng.generate(PROMPT, max_tokens=6).stats["cache_source"] == "ssd"
    eng.close()


def test_resume_of_a_record_holding_every_token_emits_no_more(tiny_model_dir, tmp_path):
    """A record written at the last step (older builds did) finishes the request as it stands."""
    from mlxcache_kernel.engine import SamplingParams
    from mlxcache_kernel.engine.cache.catalog.tables import Catalog
    from mlxcache_kernel.engine.generate.resume import InflightRecords, request_id
    from mlxcache_kernel.engine.kv.tokens import token_key

    eng = new_engine(tmp_path / "c", tiny_model_dir)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=2)
    prompt = eng.encode_prompt(PROMPT)
    done = eng.generate_tokens(prompt, params=params)  # its final state is the boundary prompt + emitted[:-1]
    assert done.stats["finish_reason"] == "length"
    eng.flush()
    ns = eng.models.get().namespace
    boundary = prompt + done.tokens[:-1]
    assert eng.cache.on_ssd(boundary, ns)
    eng.close()
    rid = request_id(ns, prompt, params.as_dict())
    catalog = Catalog(tmp_path / "c" / "checkpoints" / "catalog.db")  # as a killed process would have left it
    InflightRecords(catalog).write(
        rid, {"namespace": ns, "prompt_tokens": len(prompt), "emitted": done.tokens, "boundary_key": token_key(boundary)})
    catalog.close()
    eng = new_engine(tmp_path / "c", tiny_model_dir)
    r = eng.generate_tokens(prompt, params=params)
    assert r.stats["resumed_from"] == 6 and r.tokens == done.tokens and r.stats["decode_tokens"] == 6
    assert r.text == done.text and not InflightRecords(eng.cache.catalog).list()
    eng.close()
