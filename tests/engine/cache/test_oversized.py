"""An entry larger than a budget is one clear message, not a loop of evictions (issue 44): the RAM
budget (kept on SSD only, each use restores it) and the prefetch budget (not prefetched). Real
engines over a tiny random model; the budgets are scaled to it (the behaviour is the point)."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.magics.footer import CellResult

BUDGET = re.compile(r"this checkpoint \(\d+\.\d KiB\) is larger than the RAM budget \(19\.5 KiB\): "
                    r"kept on SSD only, each use restores it")


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


def test_a_checkpoint_larger_than_the_ram_budget_is_said_and_evicted_once_a_cell(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ram_budget_bytes=20_000)
    eng.load_model(tiny_model_dir, name="m")
    events = []
    eng.events.subscribe(events.append)
    doc, results = ids(200, 1), []
    for cell in range(4):
        r = eng.generate_tokens(doc + ids(3, 100 + cell), max_tokens=6)
        eng.flush()
        eng.poll()
        results.append(r)
        assert BUDGET.fullmatch(r.stats["cache_note"]), r.stats["cache_note"]
        footer = CellResult(r, prompt="", model="m", session=None, use_cache=True).footer()
        assert BUDGET.search(footer)
        assert BUDGET.search(str(eng.admin.why())), "%cache why says it too"
    assert [r.stats["cache_source"] for r in results] == [None, "ssd", "ssd", "ssd"]
    assert all(r.stats["cached_tokens"] == 200 for r in results[1:])
    left = Counter((e["type"], e.get("reason")) for e in events if e["type"] in ("evict", "demote", "remove"))
    # one departure a cell (its final state, once written); a restore too large to keep is lent, never
    # published and evicted again
    assert left == {("evict", "oversized"): 4, ("demote", "oversized"): 4}, left
    s = eng.stats()
    assert s["ssd_restores"] == 3 and s["oversized"] == 4 and s["ram_entries"] == 0 and s["pressure_events"] == 0
    eng.close()


def test_a_checkpoint_within_the_budget_has_no_note(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ram_budget_bytes=10 << 20)
    eng.load_model(tiny_model_dir, name="m")
    r = eng.generate_tokens(ids(200, 1), max_tokens=6)
    assert r.stats["cache_note"] is None and "larger than" not in str(eng.admin.why())
    assert eng.stats()["ram_entries"] == 1
    eng.close()


def test_a_checkpoint_larger_than_the_prefetch_budget_is_said_once_and_restored_on_use(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    small, large = ids(40, 2), ids(400, 3)
    with Engine(cache_dir=cache, prefetch_budget_bytes=0) as eng:
        eng.load_model(tiny_model_dir, name="m")
        cold = [eng.generate_tokens(p, max_tokens=6) for p in (large, small)]
        eng.flush()
        sizes = sorted(h.raw_bytes for h in eng.cache.store.entries())
    budget = (sizes[0] + sizes[1]) // 2  # the small one fits, the large one never does
    eng = Engine(cache_dir=cache, prefetch_budget_bytes=budget)
    events = []
    eng.events.subscribe(events.append)
    info = eng.load_model(tiny_model_dir, name="m")["prefetch"]
    assert info["checkpoints"] == 1 and info["too_large"] == 1
    assert re.fullmatch(r"1 cached prompt larger than the prefetch budget \(\d+\.\d KiB; the largest \d+\.\d KiB\): "
                        r"not prefetched, the first use restores it", info["note"]), info["note"]
    skipped = [e for e in events if e["type"] == "prefetch_skipped"]
    assert len(skipped) == 1 and skipped[0]["largest"] == sizes[1] and skipped[0]["note"] == info["note"]
    assert eng.cache.loading.wait_reads(30)
    r_small = eng.generate_tokens(small, max_tokens=6)
    r_large = eng.generate_tokens(large, max_tokens=6)
    assert (r_small.stats["cache_source"], r_large.stats["cache_source"]) == ("ram", "ssd")
    assert [r_large.tokens, r_small.tokens] == [c.tokens for c in cold]
    assert r_large.stats["cache_note"] is None  # RAM has room for it: kept once restored
    assert [e["type"] for e in events].count("prefetch_skipped") == 1
    eng.close()
