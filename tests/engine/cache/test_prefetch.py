"""Background restore and prefetch (cache/loading.py, cache/prefetch.py): real
threads, real files, tiny random models."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.cache.durability import WriteState
from repo_paths import SUPPORT

PROMPT = "A long shared document. " * 12 + "Question: what is it about?"
OTHERS = [f"Document number {i}: " + "words and more words. " * 10 + f"Question {i}?" for i in range(4)]
TESTS = str(SUPPORT)


def new_engine(cache_dir, model_dir, **kw) -> Engine:
    eng = Engine(cache_dir=cache_dir, **kw)
    eng.load_model(model_dir, name="tiny")
    return eng


def written(cache_dir, model_dir, prompts, **kw) -> list:
    """Generate each prompt once and close (every checkpoint durable); the results."""
    eng = new_engine(cache_dir, model_dir, prefetch_budget_bytes=0, **kw)
    out = [eng.generate(p, max_tokens=12) for p in prompts]
    assert eng.close()["failed"] == []
    return out


def flip_blocks(cache_dir: Path) -> int:
    n = 0
    for path in (cache_dir / "checkpoints" / "blocks").rglob("*.blk"):
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size // 2)
            b = f.read(1)
            f.seek(path.stat().st_size // 2)
            f.write(bytes([b[0] ^ 0x5A]))
        n += 1
    return n


def hold_read(eng: Engine):
    """Start the background read of the one job queued and stop it inside fill(), holding
    the read's own lock (released by the returned function). White-box, but real threads."""
    job = eng.cache.loading.reader.jobs()[0]
    lock = job.restore.read._lock
    lock.acquire()
    return job, lock.release


RERUN = """
import json, sys
from mlxcache_kernel.engine import Engine
eng = Engine(cache_dir={cache!r})
info = eng.load_model({model!r}, name="tiny")
assert eng.cache.loading.wait_reads(30)
r = eng.generate({prompt!r}, max_tokens=12)
s = eng.stats()
eng.close()
print(json.dumps({{"prefetch": info["prefetch"], "source": r.stats["cache_source"], "tokens": r.tokens,
                  "restores": s["ssd_restores"], "completed": s["prefetches_completed"]}}))
"""


def test_prefetch_after_load_makes_the_first_rerun_a_ram_hit_in_a_fresh_process(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    cold = written(cache, tiny_model_dir, [PROMPT])[0]
    script = RERUN.format(cache=str(cache), model=str(tiny_model_dir), prompt=PROMPT)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prefetch"]["checkpoints"] == 1
    assert out["source"] == "ram" and out["tokens"] == cold.tokens
    assert out["restores"] == out["completed"] == 1  # read once, in the background


def test_a_generation_waits_for_the_read_of_its_entry_and_does_not_read_it_twice(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    cold = written(cache, tiny_model_dir, [PROMPT])[0]
    eng = Engine(cache_dir=cache)
    with eng.cache.generating():  # the reader yields: the job is queued, allocated, not started
        eng.load_model(tiny_model_dir, name="tiny")
        job, release = hold_read(eng)
    deadline = time.monotonic() + 10
    while job.state != "reading" and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job.state == "reading"  # the reader is inside fill(), blocked on the lock
    timer = threading.Timer(0.3, release)
    timer.start()
    r = eng.generate(PROMPT, max_tokens=12)
    timer.join()
    s = eng.stats()
    assert r.tokens == cold.tokens and r.stats["cached_tokens"] == r.stats["prompt_tokens"] - 1
    assert r.stats["cache_source"] == "ssd"  # read for this request, by the reader thread
    assert s["prefetch_waits"] == 1 and s["prefetch_wait_seconds"] >= 0.2
    assert s["ssd_restores"] == 1 and s["prefetches_completed"] == 1
    assert eng.generate(PROMPT, max_tokens=12).stats["cache_source"] == "ram"
    eng.close()


def test_a_generation_takes_over_a_queued_read(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    cold = written(cache, tiny_model_dir, [PROMPT])[0]
    eng = Engine(cache_dir=cache)
    with eng.cache.generating():  # the reader yields: the job stays queued
        eng.load_model(tiny_model_dir, name="tiny")
        r = eng.generate(PROMPT, max_tokens=12)  # (a generation inside this context: fine for the test)
    s = eng.stats()
    assert r.tokens == cold.tokens and r.stats["cache_source"] == "ssd"
    assert s["ssd_restores"] == 1 and s["prefetch_waits"] == 0 and s["prefetches_in_progress"] == 0
    eng.close()


def test_prefetch_stays_under_its_budget_and_never_evicts(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    written(cache, tiny_model_dir, OTHERS)
    with Engine(cache_dir=cache, prefetch_budget_bytes=0) as probe:
        sizes = sorted(h.raw_bytes for h in probe.cache.store.entries())
    assert len(sizes) == len(OTHERS)
    one = sizes[-1]
    # The budget allows two of the four; RAM itself has room for more.
    eng = Engine(cache_dir=cache, ram_budget_bytes=40 * one, write_behind=False, prefetch_budget_bytes=2 * one + 1)
    info = eng.load_model(tiny_model_dir, name="tiny")
    assert eng.cache.loading.wait_reads(30)
    s = eng.stats()
    assert info["prefetch"]["checkpoints"] == 2 and s["prefetches_completed"] == 2, (s, list(eng.events.recent))
    assert s["prefetch_bytes"] <= 2 * one + 1 and s["ram_used_bytes"] <= 2 * one + 1
    newest = sorted(eng.cache.store.entries(), key=lambda h: -h.last_use)[:2]
    assert all(eng.cache.get_exact(h.tokens, h.namespace) is not None for h in newest)
    # A dirty entry (write-behind off), then RAM nearly full: a second prefetch only fills the room left.
    dirty = eng.generate("Something new entirely. " * 8, max_tokens=8)
    entry = eng.cache.get_exact(eng.last_key[1], eng.last_key[0])
    assert entry is not None and entry.write_state == WriteState.DIRTY
    eng.cache.ram.budget_bytes = eng.cache.ram.used_bytes + one + one // 2  # room for one more file, not two
    eng.cache.loading.prefetch_budget_bytes = 10 * one  # the room binds, not the budget
    before = s["prefetches_completed"]
    eng.cache.prefetch(entry.ns)
    assert eng.cache.loading.wait_reads(30)
    s = eng.stats()
    assert s["prefetches_completed"] - before == 1
    assert s["evictions"] == s["demotions"] == s["oversized"] == 0  # nothing left RAM for a prefetch
    assert eng.cache.get_exact(entry.tokens, entry.ns) is entry and entry.write_state == WriteState.DIRTY
    assert eng.cache.ram.used_bytes <= eng.cache.ram.budget_bytes
    assert dirty.text is not None
    eng.close()


def test_prefetch_zero_turns_it_off(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    written(cache, tiny_model_dir, [PROMPT])
    eng = new_engine(cache, tiny_model_dir, prefetch_budget_bytes=0)
    s = eng.stats()
    assert s["prefetches_started"] == 0 and s["ram_entries"] == 0 and s["prefetch_budget_bytes"] == 0
    eng.close()


def test_a_corrupt_block_during_prefetch_is_a_miss_and_quarantined(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    cold = written(cache, tiny_model_dir, [PROMPT])[0]
    assert flip_blocks(cache)
    eng = new_engine(cache, tiny_model_dir)
    assert eng.cache.loading.wait_reads(30)
    s = eng.stats()
    assert s["prefetches_failed"] == 1 and s["ssd_quarantined"] >= 1 and s["ram_entries"] == 0
    assert any(e["type"] == "restore_failed" and e.get("background") for e in eng.events.recent)
    r = eng.generate(PROMPT, max_tokens=12)  # no exception: a miss, and the same tokens
    assert r.stats["cache_source"] is None and r.tokens == cold.tokens
    assert list((cache / "checkpoints" / "quarantine").iterdir())
    eng.close()


def test_closing_with_a_read_in_flight_is_clean(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    written(cache, tiny_model_dir, [PROMPT] + OTHERS)
    eng = Engine(cache_dir=cache)
    with eng.cache.generating():
        eng.load_model(tiny_model_dir, name="tiny")
        job, release = hold_read(eng)
    deadline = time.monotonic() + 10
    while job.state != "reading" and time.monotonic() < deadline:
        time.sleep(0.005)
    assert job.state == "reading" and eng.stats()["prefetches_in_progress"] >= 2
    timer = threading.Timer(0.3, release)
    timer.start()
    eng.close()  # waits for the read in progress, drops the queued ones
    timer.join()
    assert not eng.cache.loading.reader._thread.is_alive()
    with sqlite3.connect(cache / "checkpoints" / "catalog.db") as db:
        assert db.execute("SELECT COUNT(*) FROM leases").fetchone()[0] == 0
    again = new_engine(cache, tiny_model_dir)  # everything still there and readable
    assert again.cache.loading.wait_reads(30) and again.stats()["prefetches_failed"] == 0
    assert again.cache_verify() == []
    again.close()


def test_checkpoint_restore_loads_in_the_background(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    eng = new_engine(cache, tiny_model_dir)
    first = eng.generate("Hello, who are you?", max_tokens=8, session="chat", system="Be brief.")
    eng.checkpoint_save("intro", session="chat")
    eng.close()
    eng = new_engine(cache, tiny_model_dir, prefetch_budget_bytes=0)
    info = eng.checkpoint_restore("intro")
    assert info["source"] == "loading" and info["tier"] == "ssd"
    assert eng.sessions.get("chat").turns == 1  # the chat history is back at once
    nxt = eng.generate("And what can you do?", max_tokens=8, session="chat")
    assert nxt.stats["cache_source"] in ("ram", "ssd") and nxt.stats["cached_tokens"] >= first.stats["prompt_tokens"]
    s = eng.stats()
    assert s["ssd_restores"] == 1 and s["prefetches_completed"] == 1  # one read, shared
    assert eng.checkpoint_list()[0]["tier"] == "ram+ssd"  # pinned: stays resident
    eng.close()


def test_switching_to_a_session_loads_its_state_in_the_background(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    eng = new_engine(cache, tiny_model_dir, prefetch_budget_bytes=0)
    first = eng.generate("Tell me about the sea.", max_tokens=8, session="a")
    eng.generate("Unrelated " * 20, max_tokens=4)
    eng.flush()
    eng.cache_clear()  # RAM emptied: the session's state is on SSD only
    assert eng.sessions.switch("a")["source"] == "loading"
    assert eng.cache.loading.wait_reads(30)
    assert eng.cache.session_entry("a", eng.models.get().namespace) is not None
    assert eng.sessions.switch("a")["source"] == "ram"
    nxt = eng.generate("And the mountains?", max_tokens=8, session="a")
    assert nxt.stats["cache_source"] == "ram" and nxt.stats["cached_tokens"] >= first.stats["prompt_tokens"]
    eng.sessions.switch("a")
    eng.close()


def test_prefetch_setting_and_dashboard_label(monkeypatch):
    from mlxcache_kernel.settings import MLXCache
    from mlxcache_kernel.widgets.dashboard_render import prefetch_label

    monkeypatch.setenv("MLXCACHE_PREFETCH_BUDGET", "64MiB")
    s = MLXCache()
    assert s.engine_kwargs()["prefetch_budget_bytes"] == 64 << 20
    assert s.summary()["prefetch_budget_bytes"] == 64 << 20
    for text, want in (("auto", None), ("0", 0), ("off", 0)):
        monkeypatch.setenv("MLXCACHE_PREFETCH_BUDGET", text)
        assert MLXCache().prefetch_budget_bytes() == want
    html = prefetch_label({"prefetches_in_progress": 2, "prefetch_in_progress_bytes": 3 << 20,
                           "prefetches_completed": 5, "prefetch_bytes": 9 << 20, "prefetches_failed": 1})
    assert "data-in-progress='2'" in html and "data-done='5'" in html and "1 failed" in html


def test_without_an_ssd_tier_nothing_is_read(tiny_model_dir, tmp_path):
    eng = new_engine(tmp_path / "c", tiny_model_dir, ssd=False)
    eng.generate(PROMPT, max_tokens=4, session="s")
    assert eng.sessions.switch("s")["source"] == "ram"
    assert eng.stats()["prefetches_started"] == 0 and eng.cache.loading.reader is None
    eng.close()


def test_the_dashboard_shows_prefetches_in_progress_and_done(tiny_model_dir, tmp_path):
    from mlxcache_kernel.widgets.dashboard import ResidencyDashboard

    cache = tmp_path / "c"
    written(cache, tiny_model_dir, [PROMPT])
    eng = Engine(cache_dir=cache)
    with eng.cache.generating():  # the reader yields: the read is still to do when the view is built
        eng.load_model(tiny_model_dir, name="tiny")
        db = ResidencyDashboard(eng, throttle_s=0)
        assert "data-in-progress='1'" in db.prefetch_html.value and "1 in progress" in db.prefetch_html.value
    assert eng.cache.loading.wait_reads(30)
    db.refresh()
    assert "data-in-progress='0'" in db.prefetch_html.value and "data-done='1'" in db.prefetch_html.value
    assert db.counters["prefetched"] == 1
    db.close()
    eng.close()


def test_a_rerun_right_after_a_generation_takes_its_buffers_and_loses_nothing(tiny_model_dir, tmp_path):
    """The previous run's write is queued or being written: it is dropped (or stopped at a pause
    point) and the rerun takes the buffers; the rerun's own state is then written."""
    eng = new_engine(tmp_path / "c", tiny_model_dir, prefetch_budget_bytes=0)
    cold = eng.generate(PROMPT, max_tokens=12)
    eng.flush()
    before = eng.stats()
    results = [eng.generate(PROMPT, max_tokens=12) for _ in range(4)]  # each right after the previous one
    report = eng.flush()
    s = eng.stats()
    assert all(r.tokens == cold.tokens and r.stats["cache_source"] == "ram" for r in results)
    assert report["failed"] == [] and s["writes_failed"] == 0 and s["write_error"] is None
    assert s["handovers"] > before["handovers"]  # (a write not stopped within ABORT_WAIT_S lends views instead)
    assert eng.cache.get_exact(eng.last_key[1], eng.last_key[0]).write_state == WriteState.COMMITTED
    assert eng.cache_verify() == []
    eng.close()
