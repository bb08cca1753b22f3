"""Format 2: content-addressed blocks and manifests.

Extensions write only new blocks, identical checkpoints write nothing, the
cap counts unique bytes, a corrupt block is a miss that quarantines only
that block, a kill -9 between blocks and manifest leaves no manifest naming
a missing block, gc beside writers in other processes never removes a
referenced block, format 1 files stay readable, and every cache kind
restores the same bytes from blocks as from a whole file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from blocks_worker import IDENTITY, NS, TOKENS, expected, kv_prefix, open_store, write_one
from tiny_archs import ARCHS, build_arch_model

from mlxcache_kernel.engine.cache.ssd import blocks
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.cache.ssd.restore import restore
from mlxcache_kernel.engine.cache.ssd.store import CheckpointUnavailable
from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
from mlxcache_kernel.engine.kv.caches import new_caches
from mlxcache_kernel.engine.kv.tokens import legacy_token_key
from repo_paths import SUPPORT

WORKER = str(SUPPORT / "blocks_worker.py")
BT = blocks.BLOCK_TOKENS
PER_TOKEN = 2 * 2 * 2 * 8 * 4  # kv_prefix: 2 layers x (K, V) x 2 heads x 8 dims x float32


def block_files(root: Path) -> list[Path]:
    return sorted((root / "blocks").glob("*.blk"))


def restored_arrays(store, n):
    return [np.array(a) for a in restore(store, store.find(list(TOKENS[:n]) + [-1], NS)).arrays()]


def test_extension_writes_only_new_blocks_and_identical_writes_nothing(tmp_path):
    s = open_store(tmp_path)
    first = write_one(s, 3 * BT + 10)
    assert first.bytes_deduplicated == 0 and len(block_files(tmp_path)) == 4
    again = write_one(s, 3 * BT + 10)  # a rerun: same state
    assert again.bytes_written == 0 and again.bytes_deduplicated > 3 * BT * PER_TOKEN
    grown = write_one(s, 5 * BT + 3)  # the conversation grew
    new_tokens = 5 * BT + 3 - 3 * BT  # the partial block is rewritten whole, the rest is new
    assert grown.bytes_written < (new_tokens + 1) * PER_TOKEN + 32 * 1024
    assert grown.bytes_deduplicated >= 3 * BT * PER_TOKEN
    # the longer checkpoint superseded the shorter one: its partial block is gone
    assert len(block_files(tmp_path)) == 6 and len(s.entries()) == 1
    assert all(np.array_equal(a, b) for a, b in zip(restored_arrays(s, 5 * BT + 3), expected(5 * BT + 3)))
    st = s.stats()
    assert st["blocks"] == 6 and st["block_bytes"] == sum(p.stat().st_size for p in block_files(tmp_path))
    assert st["bytes"] == st["block_bytes"] + sum(e.file_bytes for e in s.entries())


def test_prefixes_share_blocks_and_the_cap_counts_unique_bytes(tmp_path):
    s = open_store(tmp_path)
    write_one(s, 4 * BT)
    short = write_one(s, 2 * BT)  # a second question over the same document: its KV is stored
    assert short.bytes_written == short.info.file_bytes  # the manifest only
    st = s.stats()
    entries = s.entries()
    assert st["blocks"] == 4 and st["files"] == 2
    assert st["bytes"] < sum(e.file_bytes + e.block_bytes for e in entries)  # shared blocks count once
    s.ssd_budget_bytes = st["bytes"] - 1  # the cap deletes a manifest and frees only its own blocks
    write_one(s, 2 * BT)
    st = s.stats()
    assert st["files"] == 1 and st["blocks"] == 2 and len(block_files(tmp_path)) == 2
    assert st["bytes"] <= s.ssd_budget_bytes
    assert all(np.array_equal(a, b) for a, b in zip(restored_arrays(s, 2 * BT), expected(2 * BT)))


def test_corrupt_block_is_a_miss_that_quarantines_only_that_block_and_drops_its_users(tmp_path):
    s = open_store(tmp_path)
    write_one(s, 3 * BT)
    other = open_store(tmp_path / "other")  # an unrelated directory stays untouched
    write_one(other, BT)
    a = s.find(list(TOKENS[: 3 * BT]) + [-1], NS)
    bad = fmt.read_header(a.path).blocks[1]
    p = blocks.block_path(tmp_path / "blocks", bad.name)
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    p.write_bytes(bytes(raw))
    events = []
    s.on_event = events.append
    with pytest.raises(CheckpointUnavailable, match="BLAKE3"):
        restore(s, a)
    assert not p.exists() and sorted(e["type"] for e in events) == ["dropped", "quarantine"]
    assert [q.name.split(".")[1] for q in (tmp_path / "quarantine").iterdir()] == [bad.name]
    # the manifest that lost a block leaves the index at once (its file stays for gc), and the
    # blocks only it used go once the read's lease ends
    assert s.find(list(TOKENS[: 3 * BT]) + [-1], NS) is None and a.path.exists() and block_files(tmp_path) == []
    with pytest.raises(CheckpointUnavailable):  # a stale handle: a miss, nothing else moves
        restore(s, a)
    assert len(events) == 2
    assert s.gc()["files_removed"] == [str(a.path)] and not a.path.exists()
    write_one(s, 3 * BT)  # writing the same KV again brings it back
    assert all(np.array_equal(x, y) for x, y in zip(restored_arrays(s, 3 * BT), expected(3 * BT)))
    assert len(block_files(tmp_path / "other")) == 1


def _kill_before_manifest(root: Path, n: int) -> None:
    r = subprocess.run([sys.executable, WORKER, "kill-before-manifest", str(root), str(n)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr


def test_kill_between_blocks_and_manifest_leaves_no_dangling_manifest(tmp_path):
    s = open_store(tmp_path)  # open while the writer dies: gc finds what it left
    _kill_before_manifest(tmp_path, 3 * BT)
    assert len(block_files(tmp_path)) == 3 and not list(tmp_path.glob(f"{NS}/*.ckpt"))
    assert s.entries() == [] and s.find(list(TOKENS[: 3 * BT]) + [-1], NS) is None
    preview = s.gc(dry_run=True)
    assert len(preview["blocks_removed"]) == 3 and len(block_files(tmp_path)) == 3
    assert len(s.gc()["blocks_removed"]) == 3 and block_files(tmp_path) == []
    assert s.stats()["bytes"] == 0
    _kill_before_manifest(tmp_path, 2 * BT)  # a process that starts later cleans up at once
    assert len(block_files(tmp_path)) == 2
    s2 = open_store(tmp_path)
    assert block_files(tmp_path) == [] and s2.stats()["bytes"] == 0 and s2.entries() == []


def test_gc_beside_writers_in_other_processes_never_removes_a_referenced_block(tmp_path):
    open_store(tmp_path).close()
    budget = str(40 * BT * PER_TOKEN)  # the cap deletes manifests while others write and read
    procs = [subprocess.Popen([sys.executable, WORKER, "write", str(tmp_path), "12", str(seed), budget],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in range(3)]
    procs.append(subprocess.Popen([sys.executable, WORKER, "gc", str(tmp_path), "12"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    writers, collector = outs[:3], outs[3]
    assert sum(w["writes"] for w in writers) > 20 and collector["gc_runs"] > 5
    assert sum(w["wrong"] for w in writers) == 0
    assert sum(w["restores"] for w in writers) > 5
    assert sum(w["block_missing"] for w in writers) == 0, writers  # a leased manifest's blocks never went
    s = open_store(tmp_path)
    assert s.verify_all() == [] and s.stats()["quarantined"] == 0
    for e in s.entries():  # every manifest's blocks are there and restore
        assert all(np.array_equal(np.array(a), b) for a, b in zip(restore(s, e).arrays(), expected(len(e))))
    referenced = {b.name for e in s.entries() for b in fmt.read_header(e.path).blocks}
    s.gc()
    assert {p.stem for p in block_files(tmp_path)} == referenced


def test_gc_does_not_record_blocks_another_process_is_unlinking(tmp_path):
    """The interleaving behind a rare block_missing in the test above: a cap frees a manifest's
    blocks (rows gone, `freeing` set, files not yet unlinked); a gc in another process lists the
    files; had it recorded them, a writer would find them recorded and on disk and reference them,
    and the unlink would take them from under its manifest."""
    freer, collector, writer = open_store(tmp_path), open_store(tmp_path), open_store(tmp_path)
    write_one(freer, 2 * BT)
    [e] = freer.entries()
    with freer.catalog.transaction("cap") as db:  # the cap's transaction, committed; no unlink yet
        freed = [n for n, _ in freer.catalog.free_blocks(db, freer.catalog.drop_file(db, NS, e.key))]
    assert len(freed) == 2 and len(block_files(tmp_path)) == 2
    collector.gc()
    assert not set(freed) & set(collector.catalog.blocks()), "blocks being unlinked were recorded"
    done = []
    t = threading.Thread(target=lambda: done.append(write_one(writer, 2 * BT)))
    t.start()  # it waits for the unlink to end, then writes the blocks again
    for name in freed:  # the freer's after-commit work: unlink, then unfree
        blocks.block_path(tmp_path / "blocks", name).unlink()
    freer.catalog.unfree(freed)
    t.join(120)
    assert done and all(np.array_equal(a, b) for a, b in zip(restored_arrays(writer, 2 * BT), expected(2 * BT)))
    assert {p.stem for p in block_files(tmp_path)} == set(writer.catalog.blocks())


def test_format_1_files_stay_readable(tmp_path):
    s = open_store(tmp_path)
    cp = kv_prefix(100)
    path = s.prepare_path(NS, cp.tokens).with_name(legacy_token_key(cp.tokens) + ".ckpt")
    fmt.write_checkpoint(path, identity=IDENTITY, namespace=NS, tokens=cp.tokens, layout=cp.layout(),
                         min_reusable_offset=0, host_tensors=cp.host_tensors(), trimmable=True, version=1)
    assert fmt.read_header(path).version == 1
    s2 = open_store(tmp_path)  # indexed at start from its header
    assert all(np.array_equal(a, b) for a, b in zip(restored_arrays(s2, 100), expected(100)))
    write_one(s2, 100)  # a new write of the same tokens replaces it with a manifest
    assert not path.exists() and fmt.read_header(s2.entries()[0].path).version == 2


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_cache_kind_restores_the_same_bytes_from_blocks(arch, tmp_path):
    import mlx_lm

    model, _ = mlx_lm.load(str(build_arch_model(arch, tmp_path / "model")))
    caches = new_caches(model)
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, 259, 150)]
    model(mx.array([tokens]), cache=caches)
    cp = Checkpoint.capture(tokens, caches, copy=True)
    s = open_store(tmp_path / "c")
    path = s.prepare_path(NS, tokens)
    whole = fmt.write_checkpoint(path, identity=IDENTITY, namespace=NS, tokens=cp.tokens, layout=cp.layout(),
                                 min_reusable_offset=cp.min_reusable_offset, host_tensors=cp.host_tensors(),
                                 trimmable=cp.trimmable, commit=s.commit)  # no blocks: everything inline
    from_file = restore(s, s.publish(whole))
    from mlxcache_kernel.engine.cache.ssd.persist import persist
    from mlxcache_kernel.engine.cache.ssd.writer import WriteJob

    done = persist(s, WriteJob.from_checkpoint(cp, NS, IDENTITY))
    h = done.info.header
    assert h.blocks or not h.span_tensors
    from_blocks = restore(s, s.publish(done.info))
    assert from_blocks.layout() == from_file.layout() == cp.layout()
    for a, b, c in zip(from_blocks.arrays(), from_file.arrays(), cp.arrays()):
        assert a.dtype == c.dtype and np.array_equal(np.array(a), np.array(c)) and np.array_equal(np.array(b), np.array(c))
    # the continuation from the restored state equals the one from the live state
    nxt = mx.array([[5]])
    want = model(nxt, cache=cp.lend())
    got = model(nxt, cache=from_blocks.lend())
    assert np.allclose(np.array(want), np.array(got), atol=1e-5)
    os.sync()
