"""Many kernels, one cache directory: real processes (tests/support/shared_dir_worker.py)
sharing a directory through its catalogue, with real kill -9s and real disk errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from mlxcache_kernel.engine import Engine, SamplingParams
from mlxcache_kernel.engine.named.checkpoints import CheckpointNameError
from repo_paths import SUPPORT

WORKER = SUPPORT / "shared_dir_worker.py"
PARAMS = SamplingParams(max_tokens=8)


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


DOC = ids(100, 1)


class Worker:
    """Another kernel on the same directory, in its own process."""

    def __init__(self, cache: Path, model: Path, budget: int | None = None):
        args = [sys.executable, str(WORKER), str(cache), str(model)] + ([str(budget)] if budget else [])
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(SUPPORT)})
        line = self.p.stdout.readline()
        assert line, self.p.stderr.read()[-3000:]

    def __call__(self, op: str, **kw):
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, self.p.stderr.read()[-3000:]
        out = json.loads(line)
        assert "ok" in out, out
        return out["ok"]

    def start_random(self, **spec) -> None:
        self.p.stdin.write(json.dumps({"op": "random", "random": True, **spec}) + "\n")
        self.p.stdin.flush()

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write('{"op": "exit"}\n')
            self.p.stdin.flush()
            self.p.wait(60)


def engine(cache, model, **kw) -> Engine:
    eng = Engine(cache_dir=cache, **kw)
    eng.load_model(model, name="m")
    return eng


def test_a_name_survives_other_processes_caps_clear_and_gc(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    other = Worker(cache, tiny_model_dir, budget=1)  # started before the name existed; a 1-byte SSD cap
    eng = engine(cache, tiny_model_dir)
    expected = eng.generate_tokens(DOC, params=PARAMS).tokens
    eng.checkpoint_save("keep")
    other("generate", prompt=ids(60, 2))  # its cap deletes every file it may
    other("clear", ssd=True)
    other("gc")
    assert eng.checkpoint_list()[0]["tier"] == "ram+ssd"
    eng.close()
    with Engine(cache_dir=cache) as fresh:  # a restart: the name restores from SSD
        fresh.load_model(tiny_model_dir, name="m")
        assert fresh.checkpoint_restore("keep")["source"] in ("loading", "ram")  # (prefetched when the model loaded)
        assert fresh.cache.loading.wait_reads(30)
        r = fresh.generate_tokens(DOC, params=PARAMS)
        assert r.stats["cache_source"] == "ram" and r.tokens == expected
    other.close()


def test_a_running_process_finds_another_ones_checkpoint_at_once(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    eng = engine(cache, tiny_model_dir)  # running before the other process commits
    other = Worker(cache, tiny_model_dir)
    cold = other("generate", prompt=DOC)
    other("flush")
    assert eng.stats()["ssd_processes"] == 2  # the dashboard shows who shares the directory
    r = eng.generate_tokens(DOC, params=PARAMS)  # the very next lookup
    assert r.stats["cache_source"] == "ssd" and r.tokens == cold["tokens"]
    other.close()
    eng.close()


def test_catalogue_deleted_or_corrupted_while_running_is_rebuilt(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    eng = engine(cache, tiny_model_dir)
    expected = eng.generate_tokens(DOC, params=PARAMS).tokens
    eng.checkpoint_save("named")
    db = cache / "checkpoints" / "catalog.db"
    for suffix in ("", "-wal", "-shm"):  # deleted behind every process's back
        Path(str(db) + suffix).unlink(missing_ok=True)
    eng.cache_clear()  # RAM only: the next hit must come from the rebuilt index
    r = eng.generate_tokens(DOC, params=PARAMS)
    assert r.stats["cache_source"] == "ssd" and r.tokens == expected
    assert any(e["type"] == "catalog_rebuilt" for e in eng.events.recent)
    for suffix in ("-wal", "-shm"):  # now corrupted: its log gone and its pages overwritten
        Path(str(db) + suffix).unlink(missing_ok=True)
    with open(db, "r+b") as f:
        f.write(b"this is not a database" * 8)
    other = Worker(cache, tiny_model_dir, budget=1)  # a new process: sets it aside, rebuilds, and caps
    other("generate", prompt=ids(60, 3))
    assert list(db.parent.glob("catalog.db.corrupt.*")), "the corrupt catalogue is kept as evidence"
    eng.poll()  # the running engine follows to the rebuilt catalogue and re-pins its names
    other("clear", ssd=True)
    eng.cache_clear()
    assert eng.checkpoint_restore("named")["source"] == "loading"
    other.close()
    eng.close()


HOLD_LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")  # a stuck process, a backup tool, `sqlite3 catalog.db` left in a transaction
print("held", flush=True)
sys.stdin.readline()
db.execute("COMMIT")
"""


def test_a_held_write_lock_is_not_corruption_and_no_cell_waits_for_it(tiny_model_dir, tmp_path):
    """Another process holds the catalogue's write lock (until told to let go) while a kernel
    starts, generates and restores a name another kernel saved: everything returns while the
    lock is still held, the catalogue is not set aside, the delay is said once, and the
    queued writes commit once the lock is free."""
    cache = tmp_path / "c"
    other = Worker(cache, tiny_model_dir)
    saved = other("generate", prompt=DOC)
    other("save", name="doc")
    other.close()
    db = cache / "checkpoints" / "catalog.db"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        eng = engine(cache, tiny_model_dir)  # starts under the lock
        fresh = ids(50, 9)
        cold = eng.generate_tokens(fresh, params=PARAMS).tokens
        assert eng.checkpoint_restore("doc")["source"] in ("loading", "ram")
        r = eng.generate_tokens(DOC, params=PARAMS)
        assert r.stats["cache_source"] in ("ram", "ssd") and r.tokens == saved["tokens"]
        eng.generate_tokens(fresh, params=PARAMS)
        assert eng.checkpoint_save("mine")["tier"] == "ram"  # named now, on SSD once the lock is free
        report = eng.flush()
        assert report["pending"] and "locked by another process" in report["late_reason"]
        assert "locked by another process" in eng.stats()["ssd_late_reason"]
        assert holder.poll() is None, "everything above returned while the lock was held"
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        holder.wait(60)
    assert [e["type"] for e in eng.events.recent].count("ssd_late") == 1, "said once"
    assert not list(db.parent.glob("catalog.db.corrupt.*")), "a busy catalogue is not corruption"
    assert eng.flush()["failed"] == [] and eng.stats()["ssd_late_reason"] is None
    assert [c["tier"] for c in eng.checkpoint_list() if c["name"] == "mine"] == ["ram+ssd"]
    deadline = time.monotonic() + 30  # the pin reaches the catalogue with the keeper's next turn
    while "mine" not in eng.cache.catalog.pins():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    later = Worker(cache, tiny_model_dir)  # what was queued meanwhile is on SSD for everyone
    got = later("generate", prompt=fresh)  # (from RAM when the model's load prefetched it from SSD)
    assert got["tokens"] == cold and got["source"] in ("ram", "ssd") and got["cached"] == len(fresh) - 1
    later.close()
    eng.close()


def test_unusable_directory_runs_ram_only(tiny_model_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="RAM-only"):
        eng = engine(blocker / "cache", tiny_model_dir)
    s = eng.stats()
    assert not s["ssd_enabled"] and "not usable" in s["ssd_disabled_reason"]
    a = eng.generate_tokens(DOC, params=PARAMS)
    assert eng.generate_tokens(DOC, params=PARAMS).stats["cache_source"] == "ram" and a.tokens
    with pytest.raises(CheckpointNameError, match="writable cache directory"):
        eng.checkpoint_save("x")
    eng.close()


def test_another_users_directory_runs_ram_only(tiny_model_dir, tmp_path):
    foreign = tmp_path / "theirs"
    foreign.mkdir(mode=0o777)
    os.chown(foreign, 65534, 65534) if os.geteuid() == 0 else foreign.chmod(0o500)
    with pytest.warns(UserWarning, match="RAM-only"):
        eng = engine(foreign, tiny_model_dir)
    reason = eng.stats()["ssd_disabled_reason"]
    assert "another user" in reason or "denied" in reason.lower()
    assert not list(foreign.iterdir()), "nothing of ours is written there"
    eng.close()


def test_failed_writes_back_off_and_ram_stays_bounded(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    eng = engine(cache, tiny_model_dir, ram_budget_bytes=200_000)
    blocker = cache / "checkpoints" / eng.models.get().namespace
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.write_text("a file where the namespace directory should be")  # every write fails
    events = []
    eng.events.subscribe(events.append)
    sizes = []
    for i in range(8):
        eng.generate_tokens(ids(80, 10 + i), params=PARAMS)
        for _ in range(5):
            eng.poll()
        sizes.append(max((e.nbytes for e in eng.cache.entries()), default=0))
        assert eng.stats()["ram_used_bytes"] <= 200_000 + max(sizes), "RAM stays bounded"
    s = eng.stats()
    assert s["dropped_unwritable"] > 0 and blocker.name in s["write_error"]
    assert s["writes_failed"] <= 2 * 8 + 2, "failed writes back off instead of retrying every poll"
    assert len([e for e in events if e["type"] == "write_failed"]) == 1, "the error is reported once"
    blocker.unlink()
    report = eng.flush()
    assert report["failed"] == [] and eng.stats()["write_error"] is None
    eng.close()


def test_a_committed_entry_whose_file_vanished_is_written_again(tiny_model_dir, tmp_path):
    cache = tmp_path / "c"
    eng = engine(cache, tiny_model_dir)
    eng.generate_tokens(DOC, params=PARAMS)
    eng.flush()
    [entry] = eng.cache.entries()
    assert entry.write_state == "committed"
    other = Worker(cache, tiny_model_dir)
    other("clear", ssd=True)  # another process deletes the file
    eng.poll()
    assert entry.write_state in ("dirty", "pending"), "no longer durable: persist-before-evict holds"
    eng.flush()
    assert entry.write_state == "committed" and eng.cache.on_ssd(entry.tokens, entry.ns)
    other.close()
    eng.close()


STRESS_S = 45  # at least; longer on a busy machine, until the workers did enough (`enough`)


def logged(logs: list) -> list[dict]:
    """The operations the workers logged (whole lines: a live worker may be writing one)."""
    out = []
    for log in logs:
        text = log.read_text() if log.exists() else ""
        out += [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]
    return out


@pytest.mark.slow  # a minute of kills and checks: make test runs it, make test-fast does not
def test_stress_four_processes_with_kill9(tiny_model_dir, tmp_path):
    """Random operations in 4 processes on one directory, one killed every few seconds, for
    STRESS_S and until they did enough: counts, not time, however busy the machine."""
    cache = tmp_path / "c"
    prompts = [DOC[:60] + ids(20 + 10 * i, 100 + i) for i in range(5)] + [DOC]
    with Engine(cache_dir=tmp_path / "ref", ssd=False) as ref:
        ref.load_model(tiny_model_dir, name="m")
        expected = [ref.generate_tokens(p, params=PARAMS, use_cache=False).tokens for p in prompts]
    rng = random.Random(7)
    logs, workers = [], []

    def start(slot: int) -> Worker:
        w = Worker(cache, tiny_model_dir, budget=400_000 if slot < 2 else None)
        logs.append(tmp_path / f"log{len(logs)}.jsonl")
        w.start_random(seed=len(logs), prompts=prompts, max_tokens=PARAMS.max_tokens, log=str(logs[-1]))
        return w

    def enough() -> bool:
        ops = [r["op"] for r in logged(logs)]
        return kills >= 5 and ops.count("generate") > 20 and "save" in ops

    workers = [start(slot) for slot in range(4)]
    t0, kills = time.monotonic(), 0
    while time.monotonic() < t0 + STRESS_S or not enough():
        assert time.monotonic() < t0 + 900, f"not enough done in 900 s: {kills} kills, {len(logged(logs))} operations"
        time.sleep(rng.uniform(2, 6))
        slot = rng.randrange(4)
        workers[slot].kill()
        workers[slot] = start(slot)
        kills += 1
    for w in workers:
        w.kill()
    records = logged(logs)
    generated = [r for r in records if r["op"] == "generate"]
    assert len(generated) > 20
    assert all(r["out"]["tokens"] == expected[r["i"]] for r in generated), "every output equals a cold run"
    names = [r["name"] for r in records if r["op"] == "save"]
    print(f"stress: {kills} kills, {len(records)} operations, {len(generated)} generations, {len(names)} names")
    assert names and kills >= 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a usable directory: no RAM-only fallback
        eng = engine(cache, tiny_model_dir)  # the restart
    root = cache / "checkpoints"
    assert not list(root.glob("*/.*.tmp")), "no temp files remain after a restart"
    assert not list((root / "quarantine").iterdir()), "no good file was quarantined"
    rows = eng.cache.store.catalog.files()
    assert rows and all(Path(r.path).exists() for r in rows)
    assert eng.cache_verify() == [], "every catalogued file verifies"
    for name in names:  # zero named checkpoints lost
        assert eng.checkpoint_restore(name)["tier"] != "missing"
    eng.close()
