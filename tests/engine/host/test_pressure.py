"""The memory guard with entries as large as the room memory leaves them (issue 44): no loop of
publish, reclaim and restore, one event per change of state, the user told in words. Real engines
over tiny models; the guard's reading is injected (MemoryReading), scaled to the entries."""

from __future__ import annotations

from collections import Counter

import numpy as np

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.host.memory import MemoryReading


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


def engine(tmp_path, model) -> tuple[Engine, list]:
    eng = Engine(cache_dir=tmp_path / "c")
    eng.load_model(model, name="m")
    events: list = []
    eng.events.subscribe(events.append)
    return eng, events


def test_an_entry_the_memory_could_never_hold_is_kept_on_ssd_not_published_and_reclaimed(tiny_model_dir, tmp_path):
    eng, events = engine(tmp_path, tiny_model_dir)
    doc = ids(200, 1)
    cold = eng.generate_tokens(doc, max_tokens=6)
    eng.flush()
    n = eng.cache.entries()[0].nbytes
    # The rest of the process holds 8n of the 10n it may use: the high-water mark (8.5n) leaves the
    # cache's entries half of one such entry.
    eng.memory.reader = lambda: MemoryReading(8 * n + eng.cache.ram.used_bytes, 2 * n - eng.cache.ram.used_bytes)
    events.clear()
    results = []
    for cell in range(4):
        r = eng.generate_tokens(doc, max_tokens=6)  # a rerun: from SSD each time, as the note says
        eng.flush()
        eng.poll()
        results.append(r)
        assert r.stats["cache_note"].startswith("this checkpoint (")
        assert r.stats["cache_note"].endswith(f"larger than the room memory leaves the cache now "
                                              f"({n // 2 / 1024:.1f} KiB): kept on SSD only, each use restores it")
    assert all(r.tokens == cold.tokens and r.stats["cache_source"] == "ssd" for r in results)
    kinds = Counter((e["type"], e.get("reason") or e.get("state")) for e in events
                    if e["type"] in ("pressure", "evict", "drop_unwritable"))
    # the first lookup reclaims what the first cell left; then nothing is published only to be reclaimed
    assert kinds[("evict", "lookup")] == 1 and kinds[("pressure", "reclaimed")] == 1, kinds  # (reason: where)
    assert kinds[("pressure", "calm")] == 1 and sum(v for (t, _), v in kinds.items() if t == "pressure") == 2, kinds
    assert kinds[("evict", "oversized")] == 4 and len(kinds) == 4, kinds  # each once written, nothing unwritten
    s = eng.stats()
    assert s["ssd_restores"] == 4 and s["pressure_reclaims"] == 1 and s["memory_room_bytes"] == n // 2
    # memory back: the same rerun is kept in RAM again, with nothing to say
    eng.memory.reader = lambda: MemoryReading(n, 100 * n)
    eng.poll()
    r = eng.generate_tokens(doc, max_tokens=6)
    eng.flush()
    eng.poll()
    assert r.stats["cache_note"] is None and eng.stats()["ram_entries"] == 1
    assert eng.generate_tokens(doc, max_tokens=6).stats["cache_source"] == "ram"
    eng.close()


def test_memory_short_with_nothing_to_let_go_is_one_event_and_a_note(endless_model_dir, tmp_path):
    eng, events = engine(tmp_path, endless_model_dir)
    limit = 10 << 30
    eng.memory.reader = lambda: MemoryReading(int(0.9 * limit), limit - int(0.9 * limit))  # past the mark, always
    doc = ids(100, 2)
    for cell in range(3):  # each: a lookup, prefill, decode checks at 64 and 128 steps, an idle check
        r = eng.generate_tokens(doc + ids(2, cell), max_tokens=130)
        eng.flush()
        eng.poll()
        assert len(r.tokens) == 130
        assert "memory is short: this process holds 9.0 GiB, past the high-water mark (8.5 GiB of the 10.0 GiB " \
               "it may use)" in r.stats["cache_note"]
    pressure = [e for e in events if e["type"] == "pressure"]
    assert [e["state"] for e in pressure] == ["short"], pressure
    s = eng.stats()
    assert s["pressure_checks"] >= 15 and s["pressure_events"] == 1 and s["memory_note"] == pressure[0]["note"]
    assert s["dirty_entries"] == 0 and s["failed_entries"] == 0  # every state written before it left RAM
    eng.memory.reader = lambda: MemoryReading(limit // 10, limit)  # calm again: said once, the note gone
    eng.poll()
    eng.poll()
    assert [e["state"] for e in events if e["type"] == "pressure"] == ["short", "calm"]
    assert eng.stats()["memory_note"] is None
    eng.close()


def test_the_room_is_read_between_generations_not_while_one_holds_its_kv(tiny_model_dir, tmp_path):
    """While a rerun runs, the entry it took over is its live KV, in no entry: read then, the room
    would count it as the rest of the process's and call the rerun's own final state too large."""
    eng, events = engine(tmp_path, tiny_model_dir)
    doc = ids(200, 3)
    cold = eng.generate_tokens(doc, max_tokens=6)
    eng.flush()
    n = eng.cache.entries()[0].nbytes
    # The process holds 8n of the 10n it may use, n of it the entry: room for 1.5n between generations.
    eng.memory.reader = lambda: MemoryReading(8 * n, 2 * n)
    eng.poll()
    assert eng.stats()["memory_room_bytes"] == 8 * n + n // 2 - 7 * n
    for _ in range(3):
        r = eng.generate_tokens(doc, max_tokens=6)  # takes the entry over: its KV is the generation's now
        eng.flush()
        eng.poll()
        assert r.tokens == cold.tokens and r.stats["cache_source"] == "ram" and r.stats["cache_note"] is None
        assert eng.stats()["ram_entries"] == 1
    assert not [e for e in events if e["type"] in ("pressure", "evict")]
    eng.close()
