"""Power loss, in the spirit of ALICE (OSDI 2014) and lazyfs: each scenario of the fault
harness (test_faults.py) runs once in a real subprocess that records what it made durable
(tests/support/power_loss.py: file bytes at their fsync, directory entries at their
directory's fsync, catalogue transactions as SQLite's WAL makes them durable). Every
distinct directory a power cut at any moment of it would leave is rebuilt, and another
process's view checks it as the kill -9 harness does: every acknowledged checkpoint
restores with identical bytes, the named checkpoint survives, whatever is served is
exactly one version that was written (nothing corrupt is served), no good file is
quarantined, and after one gc nothing leaks.

What a power cut may do that a kill cannot, and is allowed here (the engine's design):
- a catalogue row whose manifest is missing: a commit renames its manifest inside the
  transaction and fsyncs the directory after COMMIT; the store's reconciliation at open
  drops the row (checked: after open, every indexed file exists);
- a deleted checkpoint back (clear, supersession, gc): directories that only lost files
  are fsynced by the keeper later; a resurrected checkpoint must restore exactly;
- a swept heartbeat file back without its row (its removal was never fsynced): it is
  swept as any stopped heartbeat, once DEAD_AFTER_S passed (the checker's clock is moved on).
The blocks side is not relaxed: every block the raw catalogue references has its row and
its file (blocks are durable before their rows, and unlinked only after a durable COMMIT).

Two models of what reached the disk (support/power_loss.py): "durable" (only what was fsynced: file
bytes at their fsync, names at their directory's fsync) and "eager" (every name operation up
to the cut, file bytes only as fsynced: ext4's data=writeback). The mutation tests remove one
fsync of the engine in the worker and require a failure (durable model).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from fault_worker import (CHECKPOINTS, NS, assert_nothing_leaks, bad_block, build_template, expected_digest,
                          open_store, prepare, read_logged, tokens)
from power_loss import crash_states

from mlxcache_kernel.engine.cache.catalog.liveness import DEAD_AFTER_S, HEARTBEAT_S, MISSES
from mlxcache_kernel.engine.cache.ssd import blocks
from mlxcache_kernel.engine.cache.ssd.store import CheckpointUnavailable
from mlxcache_kernel.engine.kv.tokens import token_key
from repo_paths import SUPPORT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the recorder reads fds back through /proc")

WORKER = str(SUPPORT / "fault_worker.py")
SCENARIOS = ("write", "replace", "gc", "clear", "quarantine", "restore", "temps", "deferred")
REQUIRED = {"write": "CD", "replace": "BD", "gc": "BCD", "clear": "", "quarantine": "BD", "restore": "BCD",
            "temps": "BCD", "deferred": ""}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("powerloss") / "c"
    build_template(root)
    return root


def record(template: Path, d: Path, scenario: str, mutate: str = "") -> Path:
    """Run `scenario` once, recorded; the recording's directory."""
    root, out = prepare(template, d, scenario), d / "recording"
    env = {**os.environ, "PYTHONPATH": str(SUPPORT), "MLXCACHE_POWERLOSS": str(out),
           "MLXCACHE_POWERLOSS_MUTATE": mutate}
    r = subprocess.run([sys.executable, WORKER, str(root), scenario, str(d / "log")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert any("ack" in json.loads(line) for line in (d / "log").read_text().splitlines()), "the operation failed"
    return out


def failures(template: Path, d: Path, scenario: str, mutate: str = "", first: bool = False,
             eager: bool = False) -> tuple[int, list]:
    """(crash states checked, what failed in which); eager: the data=writeback model."""
    out = record(template, d, scenario, mutate)
    states, failed = crash_states(out, eager), []
    bad = bad_block(template) if scenario == "quarantine" else None
    for i, state in enumerate(states):
        root = state.build(out, d / f"cut{i}")
        try:
            check(root, scenario, state.acked, bad)
        except AssertionError as e:
            failed.append(f"cut after {state.at} (event {state.events}, catalogue v{state.version}, "
                          f"acked={state.acked}): {e}")
            if first:
                break
    return len(states), failed


@pytest.mark.parametrize("model", ["durable", "eager"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_power_loss(template, tmp_path, scenario, model):
    n, failed = failures(template, tmp_path, scenario, eager=model == "eager")
    assert n > 3, "too few crash states: is the recorder seeing the fsyncs?"
    assert not failed, f"{len(failed)} of {n} crash states fail:\n" + "\n".join(failed[:10])


# One fsync of the engine removed (in the worker only): a power cut must then lose or corrupt something.
MUTATIONS = [
    ("ssd.blocks.fsync_file", "write"),  # a block's bytes
    ("ssd.persist.fsync_dir", "replace"),  # the blocks' names (E's are in the template already: orphans
    #                                          whose removal at open was never made durable)
    ("ssd.format.fsync_file", "write"),  # a manifest's bytes
    ("ssd.removal.fsync_dir", "replace"),  # the renamed manifest's name, before the acknowledgement
]


@pytest.mark.parametrize("mutate, scenario", MUTATIONS, ids=[m for m, _ in MUTATIONS])
def test_removing_an_fsync_fails(template, tmp_path, mutate, scenario):
    _, failed = failures(template, tmp_path, scenario, mutate, first=True)
    assert failed, f"without {mutate} every power cut of {scenario} still passes"


def served(s, name: str) -> str | None:
    """The digest of what the store serves as `name` (its tokens, not a longer checkpoint that
    extends them), or None (a miss)."""
    try:
        entry = s.find(tuple(tokens(name)) + (-1,), NS, min_len=len(tokens(name)))
        return None if entry is None or len(entry) != len(tokens(name)) else read_logged(s, name)
    except CheckpointUnavailable:
        return None


def check(root: Path, scenario: str, acked: bool, bad: str | None) -> None:
    raw_blocks_are_whole(root)
    clock = Clock()
    s = open_store(root, clock=clock)
    try:
        for e in s.entries():
            assert Path(e.path).exists(), f"indexed after open, but missing: {e.path}"
        want = {n: expected_digest(n) for n in CHECKPOINTS}
        got = {n: served(s, n) for n in CHECKPOINTS if n != "C2"}  # C2 has C's tokens
        assert got["A"] == want["A"] and "named" in s.catalog.pins(), "the named checkpoint is lost"
        versions = {n: {None, want[n]} for n in got} | {"C": {None, want["C"], want["C2"]}}
        for n, digest in got.items():
            assert digest in versions[n], f"{n}: served bytes that were never written"
        for n in REQUIRED[scenario]:
            assert got[n] == want[n], f"{n} lost or changed"
        if scenario == "write":
            assert got["E"] == want["E"] or not acked, "E acknowledged, then lost"
            assert got["B"] == want["B"] or got["E"] is not None, "B went before E replaced it"
        if scenario == "replace" and acked:
            assert got["C"] == want["C2"], "C2 acknowledged, then lost"
        quarantined = {p.name for p in (root / "quarantine").iterdir()} - {"evidence.old"}
        assert all(bad and q.startswith(f"block.{bad}.") for q in quarantined), f"quarantined, though not damaged on purpose: {quarantined}"
        s.gc()
        if set(os.listdir(root / ".heartbeats")) - {s.catalog.owner}:  # a sweep undone by the cut
            for _ in range(int(DEAD_AFTER_S) + MISSES + 2):
                clock.now += HEARTBEAT_S
                s.maintain()
            s.gc()
        assert_nothing_leaks(s)
    finally:
        s.close()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def raw_blocks_are_whole(root: Path) -> None:
    """As the cut left it: every block a file row references has its row and its file."""
    db = sqlite3.connect(root / "catalog.db")
    try:
        for (name,) in db.execute("SELECT DISTINCT block FROM refs"):
            assert db.execute("SELECT 1 FROM blocks WHERE name=?", (name,)).fetchone(), f"block {name} has no row"
            assert blocks.block_path(root / "blocks", name).exists(), f"indexed block {name} is missing"
    finally:
        db.close()


def test_key_of_c2_is_c():  # the check above relies on it
    assert token_key(tokens("C")) == token_key(tokens("C2"))
