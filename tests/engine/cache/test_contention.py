"""The shared directory under contention, with real processes (support/fault_worker.py paused at
a named point, killed with SIGKILL): a live writer's claims never expire whatever the
clock says; a manifest replaced under a reader's lease keeps the reader's blocks; a
directory used from two PID namespaces works by heartbeats, and a dead process there is
found by its missed heartbeats; a network filesystem is refused; a file that lost a
block leaves the index at first sight, is reported by verify and removed by gc; resume
records of dead requests expire; a peer that thought us dead does not keep us out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
from fault_worker import (NS, assert_nothing_leaks, expected_digest, open_store, read_digest,
                          tokens, write)

from mlxcache_kernel.engine import Engine, SamplingParams
from mlxcache_kernel.engine.host import system
from mlxcache_kernel.engine.cache.ssd import blocks
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.kv.tokens import token_key
from paused import ENV, WORKER, Clock, Paused
from repo_paths import SUPPORT


def others(store) -> list[str]:
    return [r[0] for r in store.catalog.query("SELECT owner FROM procs WHERE owner != ?", (store.catalog.owner,))]


def test_a_live_writers_claims_never_expire(root):
    """A writer paused after claiming its blocks (as behind a long generation), judged by
    heartbeats (another boot id); the others' clock jumps three days: their clear, cap
    and gc keep every block it claimed; it then commits, and what it wrote restores."""
    writer = Paused(root, "write", "write.claimed", boot="another-machine")  # E: B's blocks and two new ones
    clock = Clock()
    s = open_store(root, clock=clock)
    b_blocks = [b.name for b in fmt.read_header(s.find(tokens("B") + (-1,), NS).path).blocks]
    clock.offset = 3 * 86400.0
    s.ssd_budget_bytes = 1
    for _ in range(3):
        s.clear()  # B goes (A is named); B's own blocks stay: the writer claims them
        s.gc()
    assert s.find(tokens("B") + (-1,), NS).match_len == len(tokens("A"))
    assert all(blocks.block_path(s.blocks_root, n).exists() for n in b_blocks)
    assert writer.resume()[-1] == {"ack": "write"}
    s.ssd_budget_bytes = None
    e = s.find(tokens("E") + (-1,), NS)
    assert len(e) == len(tokens("E")) and read_digest(s, e.path) == expected_digest("E")
    s.gc()
    assert_nothing_leaks(s)
    s.close()


def test_a_manifest_replaced_under_a_readers_lease(root):
    """A reader holds C's lease (paused before reading its blocks); C is written again with
    other bytes: its old blocks stay until the read ends, the reader gets the old bytes
    exactly, then they go."""
    reader = Paused(root, "read:C", "read.fill")
    s = open_store(root)
    old = [b.name for b in fmt.read_header(s.find(tokens("C") + (-1,), NS).path).blocks]
    write(s, "C2")
    assert all(blocks.block_path(s.blocks_root, n).exists() for n in old), "a leased block was freed"
    assert reader.resume()[-1] == {"ack": "read:C", "digest": expected_digest("C")}
    assert not any(blocks.block_path(s.blocks_root, n).exists() for n in old), "freed when the lease ended"
    assert read_digest(s, s.find(tokens("C") + (-1,), NS).path) == expected_digest("C2")
    s.gc()
    assert_nothing_leaks(s)
    s.close()


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0


@pytest.mark.parametrize("how", ["unshare", "boot-id"])
def test_two_pid_namespaces_share_a_directory_by_heartbeats(root, how):
    """A writer in another PID namespace (`unshare --pid --fork`; where that is not allowed,
    another boot id) paused with a temp file and claims: pids mean nothing across, so
    heartbeats decide. Alive, its temp file and claims stay through gc; killed, it is
    found dead only after missed heartbeats, and then nothing of it is left."""
    if how == "unshare" and not _unshare_works():
        pytest.skip("unshare --pid is not allowed here (the boot-id case covers it)")
    writer = Paused(root, "write", "manifest.synced", **({"unshare": True} if how == "unshare" else
                                                      {"boot": "another-machine"}))
    clock = Clock()
    s = open_store(root, clock=clock)
    [owner] = others(s)
    temps = list(root.rglob(".*.tmp"))
    assert temps
    for _ in range(3):
        clock.offset += 10.0  # time passes, and it keeps beating
        time.sleep(1.2)
        s.gc()
    assert all(p.exists() for p in temps) and others(s) == [owner]
    assert s.catalog.query("SELECT COUNT(*) FROM claims WHERE owner=?", (owner,))[0][0] > 0
    writer.kill()
    clock.offset += 10.0
    s.maintain()
    assert others(s) == [owner], "not judged by its pid: one missed heartbeat is not death"
    for _ in range(12):  # missed heartbeats, observed over more than DEAD_AFTER_S on our clock
        clock.offset += 10.0
        time.sleep(0.01)
        s.maintain()
    assert others(s) == [] and not any(p.exists() for p in temps)
    s.gc()
    assert_nothing_leaks(s)
    s.close()


def test_a_file_that_lost_a_block_is_reported_by_verify_and_removed_by_gc(root):
    s = open_store(root)
    b = s.find(tokens("B") + (-1,), NS)
    lost = fmt.read_header(b.path).blocks[-1]  # B's own last block (A does not use it)
    blocks.block_path(s.blocks_root, lost.name).unlink()
    assert [str(p) for p, _ in s.verify_all()] == [str(b.path)]
    assert s.find(tokens("B") + (-1,), NS).match_len == len(tokens("A")), "the lookup falls back to A"
    assert s.stats()["dropped_missing_blocks"] == 1 and b.path.exists()
    assert str(b.path) in s.gc()["files_removed"] and not b.path.exists()
    assert_nothing_leaks(s)
    s.close()


def test_resume_records_of_dead_requests_expire(root):
    s = open_store(root)
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(SUPPORT)!r})
from fault_worker import open_store
s = open_store({str(root)!r})
s.catalog.inflight_put("kept", {{"namespace": "ns", "boundary_key": {token_key(tokens("A"))!r}, "emitted": [1]}})
s.catalog.inflight_put("gone", {{"namespace": "ns", "boundary_key": "0" * 64, "emitted": [1]}})
os.kill(os.getpid(), signal.SIGKILL)
"""
    assert subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120).returncode == -9
    assert {r.get("boundary_key") for r in s.catalog.inflight_all()} == {token_key(tokens("A")), "0" * 64}
    s.maintain()  # its writer is dead: the record whose state is gone goes, the resumable one stays
    assert [r["boundary_key"] for r in s.catalog.inflight_all()] == [token_key(tokens("A"))]
    s.close()


def test_a_process_taken_for_dead_registers_again(root):
    s = open_store(root)
    s.catalog.query("SELECT 1")
    with s.catalog.transaction() as db:  # a peer swept us (it thought us dead)
        db.execute("DELETE FROM procs WHERE owner=?", (s.catalog.owner,))
    deadline = time.monotonic() + 30
    while not s.catalog.query("SELECT 1 FROM procs WHERE owner=?", (s.catalog.owner,)):
        assert time.monotonic() < deadline, "the keeper did not register us again"
        time.sleep(0.05)
    s.close()


def test_a_network_filesystem_is_refused(tmp_path):
    """Processes on other hosts can only share the directory over a network filesystem: an NFS
    mount as psutil lists it is refused (the engine then runs RAM-only with the reason:
    tests/engine/host/test_filesystems.py, on a real mount); this machine's disk is used."""
    Part = type(psutil.disk_partitions(all=True)[0])
    nfs = Part(device="fileserver:/export", mountpoint=os.path.realpath(tmp_path), fstype="nfs4",
               opts="rw,relatime,vers=4.2")
    assert system.refusal(system.mount_of(tmp_path / "on nfs", [nfs])).startswith("nfs4 (a network or shared")
    assert system.unsupported_filesystem(tmp_path) is None and system.filesystem_type(tmp_path)


def test_a_lookup_falls_back_to_a_shorter_checkpoint_when_a_block_is_lost(tiny_model_dir, tmp_path):
    ids = [int(x) for x in np.random.default_rng(1).integers(3, 259, 100)]
    other = ids[:70] + [int(x) for x in np.random.default_rng(2).integers(3, 259, 20)]  # shares 70 tokens
    params = SamplingParams(max_tokens=6)
    with Engine(cache_dir=tmp_path / "ref", ssd=False) as ref:
        ref.load_model(tiny_model_dir, name="m")
        cold = ref.generate_tokens(ids + [7], params=params, use_cache=False).tokens
    eng = Engine(cache_dir=tmp_path / "c")
    eng.load_model(tiny_model_dir, name="m")
    eng.generate_tokens(other, params=params)
    eng.generate_tokens(ids, params=params)
    eng.flush()
    store = eng.cache.store
    longest = max(store.entries(), key=len)
    assert longest.tokens[:100] == tuple(ids)
    blocks.block_path(store.blocks_root, fmt.read_header(longest.path).blocks[3].name).unlink()  # tokens 96..
    eng.cache_clear()  # RAM only
    r = eng.generate_tokens(ids + [7], params=params)
    assert r.stats["cache_source"] == "ssd" and r.stats["cached_tokens"] == 70 and r.tokens == cold
    assert eng.stats()["ssd_dropped_missing_blocks"] == 1
    eng.close()


def test_a_kernel_starting_while_another_creates_the_catalogue_waits_for_it(tmp_path):
    """Two processes start on a new directory at once: the second waits for the first's schema
    (longer than a cell's wait on a busy machine) instead of running RAM-only."""
    root = tmp_path / "new" / "c"
    creating = Paused(root, "write", "schema.commit")  # holds the write lock, schema not committed
    started = time.monotonic()
    second = subprocess.Popen([sys.executable, WORKER, str(root), "write", str(tmp_path / "second.log")], env=ENV,
                              text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while time.monotonic() < started + 2.5 and second.poll() is None:  # past a cell's 1 s: it must still wait
        time.sleep(0.05)
    assert second.poll() is None, second.communicate()[1][-3000:]
    assert creating.resume() == [{"ack": "write"}]
    assert second.wait(120) == 0, second.communicate()[1][-3000:]
    assert [json.loads(x) for x in (tmp_path / "second.log").read_text().splitlines()] == [{"ack": "write"}]
    s = open_store(root)
    assert read_digest(s, s.index.entries[(NS, token_key(tokens("E")))].path) == expected_digest("E")
    s.close()
