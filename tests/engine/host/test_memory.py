"""Memory the kernel really has: pressure reclaim, exact LRU with pending and failed
writes, one write per oversized put, bounded in-flight checkpoints, a long chat
under a small budget. (Peak RSS and decode speed are measured, not asserted:
benchmarks/bench_memory.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcache_kernel.engine import Engine, GenerationError, SamplingParams
from mlxcache_kernel.engine.cache.ssd import writer as writer_mod
from mlxcache_kernel.engine.host.memory import MemoryReading, ram_budget

PARAMS = SamplingParams(max_tokens=6)


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


def engine(tmp_path, model, **kw) -> Engine:
    eng = Engine(cache_dir=tmp_path / "c", **kw)
    eng.load_model(model, name="m")
    return eng


def test_pressure_reclaims_to_the_low_water_mark_without_losing_dirty_state(tiny_model_dir, tmp_path):
    eng = engine(tmp_path, tiny_model_dir, write_behind=False)
    prompts = [ids(120, i) for i in range(6)]
    results = [eng.generate_tokens(p, params=PARAMS) for p in prompts]
    eng.flush()  # the first six are durable
    dirty = ids(120, 99)
    dirty_result = eng.generate_tokens(dirty, params=PARAMS)  # this one only in RAM
    held = sum(e.nbytes for e in eng.cache.entries())
    # a reading 100 MB over the high-water mark: reclaim aims for the low-water mark
    working, may_use = 10_000_000_000, 10_000_000_000 + 1_000_000_000
    eng.memory.reader = lambda: MemoryReading(working, may_use - working)
    freed = eng.memory.check("test")
    assert eng.stats()["pressure_reclaims"] == 1 and freed >= min(held - eng.cache.entries()[0].nbytes, 1)
    left = eng.cache.entries()
    assert all(e.write_state != "committed" for e in left), "durable entries go first"
    assert any(e.tokens[: len(dirty)] == tuple(dirty) for e in left), "a dirty entry is never dropped"
    s = eng.stats()
    assert s["memory_high_water_bytes"] == int(0.85 * may_use) and s["memory_low_water_bytes"] == int(0.75 * may_use)
    eng.memory.reader = lambda: MemoryReading(1_000, 10_000_000)  # pressure gone
    for p, r in zip(prompts + [dirty], results + [dirty_result]):
        again = eng.generate_tokens(p, params=PARAMS)
        assert again.stats["cache_source"] in ("ram", "ssd") and again.tokens == r.tokens
    eng.close()


def test_one_write_per_oversized_put_and_slices_count_their_buffers(tiny_model_dir, tmp_path):
    eng = engine(tmp_path, tiny_model_dir, ram_budget_bytes=10_000)
    prompt = ids(200, 1)
    eng.generate_tokens(prompt, params=PARAMS)  # larger than the whole budget
    eng.flush()
    s = eng.stats()
    assert s["writes_queued"] == s["writes_committed"] == 1 and s["ssd_files"] == 1
    assert s["ram_entries"] == 0, "an oversized entry leaves RAM once its one write committed"
    # a prefix of a restored file keeps the whole restored buffers alive: it counts them
    entry, source = eng.cache.restore_exact(tuple(prompt[:50]), eng.models.get().namespace)
    assert source == "ssd" and entry.nbytes > 4 * entry.checkpoint.kv_bytes
    eng.close()


def test_checkpoint_every_needs_the_ssd_tier(tiny_model_dir, tmp_path):
    eng = engine(tmp_path, tiny_model_dir, ssd=False)
    with pytest.raises(GenerationError, match="SSD tier"):
        eng.generate_tokens(ids(20, 1), params=PARAMS, checkpoint_every=2)
    eng.close()


def test_inflight_checkpoints_stay_bounded_while_the_disk_is_slow(tiny_model_dir, tmp_path, monkeypatch):
    gate = threading.Event()
    real = writer_mod.fmt.write_checkpoint
    monkeypatch.setattr(writer_mod.fmt, "write_checkpoint", lambda *a, **k: (gate.wait(60), real(*a, **k))[1])
    eng = engine(tmp_path, tiny_model_dir)
    eng.generate_tokens(ids(80, 1), params=PARAMS)  # its write now holds the writer at the gate
    seen = []

    def watch(_text):
        seen.append(eng.cache.writer.pending(urgent_only=True)[0])

    r = eng.generate_tokens(ids(100, 3), max_tokens=40, checkpoint_every=1, on_text=watch)
    assert max(seen) == 1, "while the disk is busy, one interval waits: each newer one replaces it"
    s = eng.stats()
    assert s["inflight_replaced"] > 10 and s["inflight_queued"] == 1
    gate.set()
    eng.flush()
    assert len(r.tokens) == 40
    eng.close()


# --- eviction order: exact LRU among the entries that may leave, with pending and failed writes ---

@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory):
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "second", seed=1)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["gen", "gen_failing", "flush", "poll"]), st.integers(0, 7)),
                    min_size=3, max_size=14))
def test_eviction_is_lru_among_entries_that_may_leave(tiny_model_dir, second_model_dir, tmp_path_factory, ops):
    root = tmp_path_factory.mktemp("lru")
    eng = Engine(cache_dir=root / "c", ram_budget_bytes=250_000, write_behind=False)
    eng.load_model(tiny_model_dir, name="ok")
    eng.load_model(second_model_dir, name="bad")  # another namespace...
    blocker = root / "c" / "checkpoints" / eng.models.get("bad").namespace
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.write_text("x")  # ...whose writes always fail
    evicted = []
    eng.events.subscribe(lambda e: evicted.append(e) if e["type"] in ("evict", "demote") else None)
    for op, i in ops:
        if op.startswith("gen"):
            eng.generate_tokens(ids(60, i), params=PARAMS, model="bad" if op == "gen_failing" else "ok")
        elif op == "flush":
            eng.flush()
        else:
            eng.poll()
        if eng.cache.ram.over_budget():  # the budget is soft only behind an entry that must stay
            first = eng.cache.ram.victims()[0]
            assert first.write_state != "committed" and not eng.cache.store.has_durable_prefix(first.tokens, first.ns)
    for e in evicted:  # nothing left RAM without a committed copy, but writes that kept failing
        if e["type"] == "evict" and e.get("reason") not in ("oversized",):
            assert e["ns"] != eng.models.get("bad").namespace or eng.stats()["dropped_unwritable"] > 0
    eng.close()


def test_chats_under_a_small_budget_stay_within_it(tiny_model_dir, tmp_path):
    """Four chats in turn, twelve turns: once their writes are durable, older states leave
    RAM, so the RAM the cache holds stays within the budget plus the entry in use, and
    every chat continues exactly (peak RSS is measured in benchmarks/bench_memory.py)."""
    budget = 300_000
    eng = engine(tmp_path, tiny_model_dir, ram_budget_bytes=budget)
    for turn in range(12):
        eng.generate(f"Turn {turn}: one more fact about rivers.", max_tokens=6, session=f"chat{turn % 4}")
        eng.flush()
        biggest = max((e.nbytes for e in eng.cache.entries()), default=0)
        assert eng.stats()["ram_used_bytes"] <= budget + biggest, turn
    s = eng.stats()
    assert s["demotions"] > 0 and s["failed_entries"] == 0 and s["dirty_entries"] == 0
    r = eng.generate("And one more.", max_tokens=6, session="chat0")  # a demoted chat comes back from SSD
    assert r.stats["cache_source"] == "ssd" and r.stats["cached_tokens"] > 0
    eng.close()


READING = """
import json
import numpy as np
from mlxcache_kernel.engine.host.memory import read_memory
from mlxcache_kernel.engine.host.system import physical_memory
before = read_memory()
held = np.ones(256 << 20, dtype=np.uint8)  # written: resident
during = read_memory()
del held  # a block this large is unmapped at once
after = read_memory()
print(json.dumps([before.working, during.working, after.working, during.available, physical_memory()]))
"""


def test_a_reading_follows_what_the_process_holds_now():
    """The working set is the resident memory now (not the peak), read by psutil on Linux and
    macOS alike, in a fresh process (no MLX memory of other tests to hide it)."""
    r = subprocess.run([sys.executable, "-c", READING], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    before, during, after, available, physical = json.loads(r.stdout.splitlines()[-1])
    assert during - before >= 240 << 20 and during - after >= 240 << 20, (before, during, after)
    assert 0 < available < physical and during < physical


def test_an_unset_budget_adapts_where_the_memory_can_be_read():
    """(Where it cannot, a fixed budget: test_without_proc.py.)"""
    assert ram_budget(None) is None and ram_budget(1 << 30) == 1 << 30
