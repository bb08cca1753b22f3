"""A process taken for dead never destroys what others wrote (issue 27): real worker
processes (support/fault_worker.py) paused at a named point and frozen whole (SIGSTOP: no
heartbeat, as Ctrl-Z, a debugger or `docker pause`), judged by heartbeats (another boot
id), swept as dead by a peer whose injected clock runs ahead; the peer goes on (writes
the same blocks again, gc); the worker then resumes where it stopped. Every checkpoint
anyone acknowledged restores identically, and after one gc nothing leaks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fault_worker import (NS, assert_nothing_leaks, expected_digest, open_store, read_digest,
                          tokens, write)
from paused import ENV, WORKER, Clock, Paused

from mlxcache_kernel.engine.cache.catalog.database import CatalogBusy
from mlxcache_kernel.engine.cache.ssd import blocks
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.kv.tokens import token_key


def others(s) -> list[str]:
    return [r[0] for r in s.catalog.query("SELECT owner FROM procs WHERE owner != ?", (s.catalog.owner,))]


def sweep_as_dead(s, clock: Clock) -> None:
    """Our clock runs ahead while the frozen worker's heartbeat stands still: it is swept."""
    assert others(s)
    for _ in range(12):  # missed heartbeats over more than DEAD_AFTER_S on our clock
        clock.offset += 10.0
        s.maintain()
    assert others(s) == [], "the frozen worker was not taken for dead"


def block_names(s, name: str) -> list[str]:
    e = s.index.entries[(NS, token_key(tokens(name)))]
    return [b.name for b in fmt.read_header(e.path).blocks]


def restores(s, name: str, want: str | None = None) -> None:
    e = s.find(tuple(tokens(name)) + (-1,), NS, min_len=len(tokens(name)))
    assert e is not None and len(e) == len(tokens(name)), f"{name} is not indexed"
    assert read_digest(s, e.path) == expected_digest(want or name), f"{name} does not restore identically"


def test_paused_after_a_committed_clear_while_a_peer_rewrites_the_same_blocks(root):
    """The worker's clear committed (rows gone, blocks marked `freeing` by it), then it froze;
    the peer sweeps it (takes the marks over, unlinks), writes C again (the same KV: the same
    block names) and acknowledges it. Resumed, the worker's unlinks of C's blocks must not
    happen: its marks are not its own any more."""
    worker = Paused(root, "clear", "clear.committed", boot="another-machine")
    worker.stop()
    clock = Clock()
    s = open_store(root, clock=clock)
    sweep_as_dead(s, clock)
    write(s, "C")  # acknowledged
    rewritten = block_names(s, "C")
    assert all(blocks.block_path(s.blocks_root, n).exists() for n in rewritten)
    assert worker.resume()[-1] == {"ack": "clear"}
    s.sync()
    assert all(blocks.block_path(s.blocks_root, n).exists() for n in rewritten), "a resumed worker unlinked C"
    restores(s, "C")
    restores(s, "A")  # named: the clear kept it
    assert "named" in s.catalog.pins()
    s.gc()
    restores(s, "C")
    assert_nothing_leaks(s)
    s.close()


def test_paused_in_replace_between_block_rename_and_commit(root):
    """The worker replacing C (C2: other bytes) froze after its new blocks were renamed into
    place; the peer sweeps it (its claims go) and gc removes the blocks nothing references.
    Resumed, its commit finds its claims gone and writes again: what it acknowledges restores."""
    worker = Paused(root, "replace", "write.blocks_synced", boot="another-machine")
    worker.stop()
    clock = Clock()
    s = open_store(root, clock=clock)
    sweep_as_dead(s, clock)
    s.gc()
    referenced = {b.name for e in s.entries() for b in fmt.read_header(e.path).blocks}
    assert {p.stem for p in s.blocks_root.glob("*.blk")} == referenced, "the worker's new blocks were not removed"
    log = worker.resume()
    assert log[-1] == {"ack": "replace"} and "LostClaims" in log[0].get("error", ""), log
    s.sync()
    restores(s, "C", "C2")
    for name in "ABD":
        restores(s, name)
    s.gc()
    restores(s, "C", "C2")
    assert_nothing_leaks(s)
    s.close()


def test_paused_inside_the_commit_transaction(root):
    """The worker froze holding the write lock (inside its commit, manifest renamed): the peer
    cannot sweep it or write (busy: a wait, never a failure that loses anything) and reads go
    on; resumed, its commit completes (whoever then finishes the freeing of C's old blocks,
    the worker or a peer that swept it), and everything acknowledged restores."""
    worker = Paused(root, "replace", "commit.renamed", boot="another-machine")
    worker.stop()
    clock = Clock()
    s = open_store(root, clock=clock)
    restores(s, "C")  # reads go on (the old version: the new one is not committed)
    clock.offset += 120.0
    with pytest.raises(CatalogBusy):
        for _ in range(12):
            clock.offset += 10.0
            s.maintain()  # the sweep needs the write lock
    with pytest.raises(CatalogBusy):
        write(s, "E")
    assert s.stats()["late_reason"]
    assert worker.resume()[-1] == {"ack": "replace"}
    for _ in range(12):
        clock.offset += 10.0
        s.maintain()
    write(s, "E")
    s.sync()
    restores(s, "C", "C2")
    restores(s, "E")
    for name in "AD":
        restores(s, name)
    s.gc()
    restores(s, "C", "C2")
    assert_nothing_leaks(s)
    s.close()


@pytest.mark.parametrize("action", ["enospc", "eio"])
def test_own_freeing_marks_are_ended_when_the_unfree_commit_fails(root, action):
    """The COMMIT that ends a clear's `freeing` marks fails (a full or failing disk): the clear
    is still done, the marks do not outlive the failure (the keeper ends them), and the same
    process's next write of those blocks goes through instead of waiting for itself."""
    log = root.parent / "log"
    r = subprocess.run([sys.executable, WORKER, str(root), "clear-rewrite", str(log)], capture_output=True, text=True,
                       timeout=120, env={**ENV, "MLXCACHE_FAULT": f"unfree.commit:{action}"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x) for x in log.read_text().splitlines()] == [{"ack": "clear-rewrite"}]
    s = open_store(root)
    assert s.catalog.query("SELECT COUNT(*) FROM freeing")[0][0] == 0
    restores(s, "C")
    restores(s, "A")
    s.gc()
    assert_nothing_leaks(s)
    s.close()


def test_a_wait_for_freeing_marks_names_their_holder(root):
    s = open_store(root)
    with s.catalog.transaction() as db:
        db.execute("INSERT INTO freeing VALUES(?, ?)", ("f" * 64, s.catalog.owner))
        db.execute("INSERT INTO freeing VALUES(?, ?)", ("e" * 64, "0123456789abcdef"))
    held = s.catalog.being_freed(["f" * 64, "e" * 64, "d" * 64])
    assert sorted(held) == ["e" * 64, "f" * 64]
    assert s.catalog.describe(held["f" * 64]).startswith("this process (pid ")
    assert "no longer registered" in s.catalog.describe(held["e" * 64])
    s.close()
