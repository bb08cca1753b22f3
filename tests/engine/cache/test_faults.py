"""Crash tests in the spirit of SQLite's: a named fault point at every filesystem and
catalogue step of write, commit, replace, gc, clear, quarantine and restore
(engine/cache/faults.py). Each point runs in a real subprocess (support/fault_worker.py, the
storage layer without MLX) that is killed there (SIGKILL) or gets ENOSPC or EIO there
(a COMMIT that fails: SQLITE_FULL after SQLite's own rollback, or SQLITE_IOERR with the
transaction open). A checker, another process's view, then asserts: the catalogue the
process left names no missing file or block; every acknowledged checkpoint restores
with identical bytes; no named checkpoint is lost; no good file is quarantined; and
after one gc nothing leaks (files, blocks, rows, temp files, claims) and the byte
totals are exact.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from fault_worker import (CHECKPOINTS, assert_nothing_leaks, bad_block, build_template, expected_digest, open_store,
                          prepare, read_digest, tokens)

from mlxcache_kernel.engine.cache.ssd import blocks
from mlxcache_kernel.engine.kv.tokens import token_key
from paused import ENV, WORKER
BACKGROUND = ("keep.", "prune.", "sweep.")  # the keeper thread's own steps: when they run depends on the clock

# Every point each scenario reaches once its store is open, in order (checked against a trace).
SCENARIOS = {
    "write": [
        "reserve.begin", "reserve.commit", "reserve.committed", "write.claimed", "block.written", "block.written",
        "block.synced", "block.renamed", "block.synced", "block.renamed", "dir.fsync", "write.blocks_synced",
        "record.begin", "record.commit", "record.committed", "manifest.written", "manifest.synced", "commit.begin",
        "commit.rename", "commit.renamed", "commit.commit", "commit.committed", "commit.unlink", "commit.unlinked",
        "dir.fsync", "publish.begin", "publish.commit", "publish.committed", "publish.unlink", "publish.unlinked",
        "close.begin", "close.commit", "close.committed",
    ],
    "replace": [
        "reserve.begin", "reserve.commit", "reserve.committed", "write.claimed", "block.written", "block.written",
        "block.synced", "block.renamed", "block.synced", "block.renamed", "dir.fsync", "write.blocks_synced",
        "record.begin", "record.commit", "record.committed", "manifest.written", "manifest.synced", "commit.begin",
        "commit.rename", "commit.renamed", "commit.commit", "commit.committed", "commit.unlink", "fence.begin",
        "fence.commit", "fence.committed", "commit.unlinked", "dir.fsync", "unfree.begin", "unfree.commit",
        "unfree.committed", "publish.begin", "publish.commit", "publish.committed", "publish.unlink",
        "publish.unlinked", "close.begin", "close.commit", "close.committed",
    ],
    "gc": [
        "reconcile.begin", "reconcile.commit", "reconcile.committed", "reconcile.unlink", "reconcile.unlinked",
        "gc.begin", "gc.commit", "gc.committed", "gc.unlink", "fence.begin", "fence.commit", "fence.committed",
        "gc.unlinked", "unfree.begin", "unfree.commit", "unfree.committed", "close.begin", "close.commit",
        "close.committed",
    ],
    "clear": [
        "clear.begin", "clear.commit", "clear.committed", "clear.unlink", "fence.begin", "fence.commit",
        "fence.committed", "clear.unlinked", "unfree.begin", "unfree.commit", "unfree.committed", "close.begin",
        "close.commit", "close.committed",
    ],
    "quarantine": [
        "lease.begin", "lease.commit", "lease.committed", "read.fill", "block.confirm", "quarantine.begin",
        "quarantine.commit", "quarantine.committed", "quarantine.unlink", "fence.begin", "quarantine.rename",
        "fence.commit", "fence.committed", "quarantine.unlinked", "dir.fsync", "dir.fsync", "unfree.begin",
        "unfree.commit", "unfree.committed", "unlease.begin", "unlease.commit", "unlease.committed",
        "unlease.unlink", "fence.begin", "fence.commit", "fence.committed", "unlease.unlinked", "unfree.begin",
        "unfree.commit", "unfree.committed", "close.begin", "close.commit", "close.committed",
    ],
    "restore": [
        "lease.begin", "lease.commit", "lease.committed", "read.fill", "unlease.begin", "unlease.commit",
        "unlease.committed", "unlease.unlink", "unlease.unlinked", "close.begin", "close.commit", "close.committed",
    ],
    "temps": [
        "stale.unlink", "dir.fsync", "stale.unlink", "dir.fsync", "reconcile.begin", "reconcile.commit",
        "reconcile.committed", "reconcile.unlink", "reconcile.unlinked", "gc.begin", "gc.commit", "gc.committed",
        "gc.unlink", "fence.begin", "fence.commit", "fence.committed", "gc.unlinked", "unfree.begin",
        "unfree.commit", "unfree.committed", "close.begin", "close.commit", "close.committed",
    ],
}
EVERY = ("dir.fsync", "stale.unlink")  # points that are another step each time reached: each one is tried


def run_worker(root: Path, scenario: str, log: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, WORKER, str(root), scenario, str(log)], env={**ENV, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("faults") / "c"
    build_template(root)
    return root


@pytest.fixture(scope="module")
def traces(template, tmp_path_factory) -> dict:
    """Each scenario once, every point it reaches recorded (after its store opened)."""
    out = {}
    for scenario in SCENARIOS:
        root = prepare(template, tmp_path_factory.mktemp("trace"), scenario)
        trace = root.parent / "trace"
        r = run_worker(root, scenario, root.parent / "log", MLXCACHE_FAULT_TRACE=str(trace))
        assert r.returncode == 0, r.stderr
        before, op = (part.split() for part in trace.read_text().split("--- op\n", 1))
        out[scenario] = ([p for p in before if not p.startswith(BACKGROUND)], [p for p in op if not p.startswith(BACKGROUND)])
    return out


def cases():
    """Each point once per scenario (each time reached for those in EVERY): killed, and ENOSPC
    there; EIO too where it differs (a COMMIT, which SQLite does not roll back then, a read, a
    directory fsync). A replace repeats the write's steps up to its manifest: only its own are
    run; closing, once."""
    for scenario, points in SCENARIOS.items():
        skip = points.index("manifest.synced") + 1 if scenario == "replace" else 0
        for i, point in enumerate(points):
            nth = points[:i].count(point) + 1
            if i < skip or (nth > 1 and point not in EVERY) or (point.startswith("close.") and scenario != "write"):
                continue
            eio = point.endswith(".commit") or point in ("read.fill", "block.confirm", "dir.fsync")
            actions = ["kill", "enospc"] + (["eio"] if eio else [])
            for action in actions:
                yield pytest.param(scenario, point, action, nth, id=f"{scenario}-{point}-{action}" + (
                    f"-{nth}" if nth > 1 else ""))


def test_every_point_is_listed(traces):
    """The lists above are what the code reaches: a point added or lost shows here."""
    for scenario, points in SCENARIOS.items():
        assert traces[scenario][1] == points, f"{scenario} now reaches: {traces[scenario][1]}"


@pytest.mark.parametrize("scenario, point, action, nth", list(cases()))
def test_fault(template, traces, tmp_path, scenario, point, action, nth):
    before, _ = traces[scenario]  # (the points reached while the store opened count too)
    root = prepare(template, tmp_path, scenario)
    log = tmp_path / "log"
    env = {"MLXCACHE_FAULT": f"{point}:{action}@{before.count(point) + nth}"}  # the operation's nth time there
    r = run_worker(root, scenario, log, **env)
    assert r.returncode == (-9 if action == "kill" else 0), r.stderr[-3000:]
    acked = any("ack" in json.loads(line) for line in log.read_text().splitlines()) if log.exists() else False
    check(root, scenario, acked, bad=bad_block(template) if scenario == "quarantine" else None)


@pytest.mark.parametrize("action", ["kill", "enospc", "eio"])
def test_deferred_fsync_fault(template, tmp_path, action):
    """The keeper's deferred directory fsync (after a clear; run in the operation, not left to
    the keeper's clock): a failed one is kept and tried again."""
    root = prepare(template, tmp_path, "deferred")
    trace, log = tmp_path / "trace", tmp_path / "log"
    r = run_worker(root, "deferred", log, MLXCACHE_FAULT=f"keep.fsync:{action}", MLXCACHE_FAULT_TRACE=str(trace))
    assert r.returncode == (-9 if action == "kill" else 0), r.stderr[-3000:]
    tried = trace.read_text().split("--- op\n", 1)[1].split().count("keep.fsync")
    assert tried >= (1 if action == "kill" else 3), f"keep.fsync reached {tried} times"  # two directories, one again
    acked = any("ack" in json.loads(line) for line in log.read_text().splitlines()) if log.exists() else False
    assert acked or action == "kill"
    check(root, "deferred", acked)


def check(root: Path, scenario: str, acked: bool, bad: str | None = None) -> None:
    raw_catalogue_is_whole(root)
    s = open_store(root)
    try:
        indexed = {e.key: e for e in s.entries()}

        def state(name: str) -> str | None:
            e = indexed.get(token_key(tokens(name)))
            return None if e is None else read_digest(s, e.path)

        want = {n: expected_digest(n) for n in CHECKPOINTS}
        assert state("A") == want["A"] and "named" in s.catalog.pins(), "the named checkpoint is lost"
        required = {"write": "CD", "replace": "BD", "gc": "BCD", "clear": "", "quarantine": "BD", "restore": "BCD",
                    "temps": "BCD", "deferred": ""}
        for name in required[scenario]:
            assert state(name) == want[name], f"{name} lost or changed"
        if scenario == "write":
            e = state("E")
            assert e in (None, want["E"]) and (e is not None or not acked)
            assert state("B") == want["B"] or e is not None, "B went before E replaced it"
        if scenario == "replace":
            assert state("C") == want["C2"] if acked else state("C") in (want["C"], want["C2"])
        if scenario in ("clear", "deferred"):
            for name in "BCD":
                assert state(name) in ((None,) if acked else (None, want[name]))
        quarantined = {p.name for p in (root / "quarantine").iterdir()}
        assert quarantined - {"evidence.old"} <= ({q for q in quarantined if q.startswith(f"block.{bad}.")} if bad
                                                 else set()), f"good files quarantined: {quarantined}"
        s.gc()
        assert_nothing_leaks(s)
    finally:
        s.close()


def raw_catalogue_is_whole(root: Path) -> None:
    """As the faulted process left it, before anyone reconciles: every file row's file
    exists, every block it references has a row and a file."""
    db = sqlite3.connect(root / "catalog.db")
    try:
        for (path,) in db.execute("SELECT path FROM files"):
            assert (root / path).exists(), f"indexed manifest {path} is missing"
        for (name,) in db.execute("SELECT DISTINCT block FROM refs"):
            assert db.execute("SELECT 1 FROM blocks WHERE name=?", (name,)).fetchone(), f"block {name} has no row"
            assert blocks.block_path(root / "blocks", name).exists(), f"indexed block {name} is missing"
    finally:
        db.close()
