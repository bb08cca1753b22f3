"""The SSD tier: index, lookup, restore, quarantine, capacity, crash safety."""

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
from mlxcache_kernel.engine.cache.ssd import capacity
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.cache.ssd.restore import restore
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore, CheckpointUnavailable

IDENTITY = {"artifact": "a" * 64, "config": "c1", "tokenizer": "t1", "kv_scheme": "fp"}
IMPORTS = """
from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
from mlxcache_kernel.engine.cache.ssd.restore import restore
"""


def make_checkpoint(tokens, heads=2, head_dim=8, layers=2, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    caches = []
    for _ in range(layers):
        c = KVCache()
        shape = (1, heads, len(tokens), head_dim)
        c.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
        caches.append(c)
    return Checkpoint.capture(tokens, caches)


def commit(store, cp, ns="ns", identity=IDENTITY, trimmable=None, min_reusable_offset=0):
    path = store.prepare_path(ns, cp.tokens)
    info = fmt.write_checkpoint(
        path, identity=identity, namespace=ns, tokens=cp.tokens, layout=cp.layout(),
        min_reusable_offset=min_reusable_offset, host_tensors=cp.host_tensors(),
        trimmable=cp.trimmable if trimmable is None else trimmable, commit=store.commit,
    )
    return store.publish(info)


def same_arrays(a, b):
    return all(
        np.array_equal(np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32)))
        for x, y in zip(a.arrays(), b.arrays())
    ) and len(a.arrays()) == len(b.arrays())


def new_store(path, **kw):
    s = CheckpointStore(path, **kw)
    s.register_namespace("ns", IDENTITY)
    return s


def test_index_from_headers_and_restore(tmp_path):
    s = new_store(tmp_path / "c")
    cp = make_checkpoint(list(range(1, 21)), dtype=mx.bfloat16)
    commit(s, cp)
    s2 = new_store(tmp_path / "c")
    [e] = s2.entries()
    assert e.tokens == cp.tokens and e.trimmable and e.namespace == "ns"
    hit = s2.find(list(range(1, 30)), "ns")
    assert hit.match_len == 20
    restored = restore(s2, hit)
    assert restored.tokens == cp.tokens and restored.layout() == cp.layout()
    assert restored.arrays()[0].dtype == mx.bfloat16 and same_arrays(restored, cp)
    st = s2.stats()
    assert st["files"] == 1 and st["restores"] == 1
    assert st["restore_bytes"] == sum(h.nbytes for h in cp.host_tensors()) and st["restore_seconds"] > 0


def test_find_longest_usable_prefix(tmp_path):
    s = new_store(tmp_path)
    base = list(range(1, 41))
    commit(s, make_checkpoint(base[:10]))
    commit(s, make_checkpoint(base[:30] + [999] * 5), trimmable=False)
    commit(s, make_checkpoint(base[:20] + [777] * 10))
    # the 35-token file diverges at 30 but is not trimmable; the 30-token one trims to 20
    hit = s.find(base, "ns")
    assert hit.match_len == 20 and len(hit) == 30
    # exact non-trimmable file is usable at its full length
    hit = s.find(base[:30] + [999] * 5 + [1], "ns")
    assert hit.match_len == 35 and len(hit) == 35
    # capped at len(prompt) - 1: the exact prompt never counts fully
    hit = s.find(base[:10], "ns")
    assert hit.match_len == 9
    assert s.find(base[:10], "ns", max_len=5).match_len == 5
    assert s.find([5000, 1, 2], "ns") is None
    assert s.find(base, "other") is None  # unregistered namespace is never served


def test_min_reusable_offset(tmp_path):
    s = new_store(tmp_path)
    commit(s, make_checkpoint(list(range(1, 31))), min_reusable_offset=25)
    assert s.find(list(range(1, 21)) + [0], "ns") is None
    assert s.find(list(range(1, 28)) + [0], "ns").match_len == 27
    assert not s.has_durable_prefix(list(range(1, 21)), "ns")
    assert s.has_durable_prefix(list(range(1, 27)), "ns")


def test_has_durable_prefix(tmp_path):
    s = new_store(tmp_path)
    commit(s, make_checkpoint(list(range(1, 31))))
    commit(s, make_checkpoint(list(range(100, 131))), trimmable=False)
    assert s.has_durable_prefix(list(range(1, 31)), "ns")
    assert s.has_durable_prefix(list(range(1, 11)), "ns")  # trimmable covers it
    assert s.has_durable_prefix(list(range(100, 131)), "ns")
    assert not s.has_durable_prefix(list(range(100, 111)), "ns")  # not trimmable
    assert not s.has_durable_prefix(list(range(1, 11)), "other")


def _events(tmp_path, **kw):
    ev = []
    s = CheckpointStore(tmp_path / "c", on_event=ev.append, **kw)
    s.register_namespace("ns", IDENTITY)
    return s, ev


@pytest.mark.parametrize("damage", ["flip_tensor", "truncate_tensor"])
def test_restore_quarantines_bad_tensor_data(tmp_path, damage):
    s, ev = _events(tmp_path)
    cp = make_checkpoint(list(range(1, 41)))
    e = commit(s, cp)
    h = fmt.read_header(e.path)
    if damage == "flip_tensor":
        with open(e.path, "r+b") as f:
            f.seek(h.tensors[-1].offset + 3)
            f.write(b"\xff\xfe")
    hit = s.find(list(range(1, 50)), "ns")
    if damage == "truncate_tensor":
        os.truncate(e.path, h.tensors[-1].offset + 10)
    with pytest.raises(CheckpointUnavailable):
        restore(s, hit)
    assert not e.path.exists() and len(os.listdir(tmp_path / "c" / "quarantine")) == 1
    assert [x["type"] for x in ev] == ["quarantine"] and ev[0]["path"] == str(e.path)
    assert s.stats()["quarantined"] == 1 and s.stats()["files"] == 0
    assert s.find(list(range(1, 50)), "ns") is None
    with pytest.raises(CheckpointUnavailable):  # a stale entry is a miss, never a crash
        restore(s, hit)
    assert len(ev) == 1


@pytest.mark.parametrize("damage", ["magic", "json", "truncated", "misnamed"])
def test_bad_files_quarantined_at_index_build(tmp_path, damage):
    s, _ = _events(tmp_path)
    e = commit(s, make_checkpoint(list(range(1, 41))))
    data = e.path.read_bytes()
    if damage == "magic":
        e.path.write_bytes(b"GARBAGE!" + data[8:])
    elif damage == "json":
        e.path.write_bytes(data[:60] + b"}" + data[61:])
    elif damage == "truncated":
        e.path.write_bytes(data[: len(data) // 2])
    elif damage == "misnamed":  # a valid file under another prefix's name
        os.replace(e.path, e.path.with_name("0" * 64 + ".ckpt"))
    s2, ev = _events(tmp_path)
    assert s2.entries() == [] and s2.stats()["quarantined"] == 1
    assert ev[0]["type"] == "quarantine" and ev[0]["reason"]
    assert len(os.listdir(tmp_path / "c" / "quarantine")) == 1


def test_newer_format_file_is_left_alone(tmp_path):
    s, _ = _events(tmp_path)
    e = commit(s, make_checkpoint(list(range(1, 41))))
    data = e.path.read_bytes()
    e.path.write_bytes(data[:8] + (99).to_bytes(4, "little") + data[12:])  # as a newer build would write it
    s2, ev = _events(tmp_path)
    assert s2.entries() == [] and s2.stats()["newer_format_files"] == 1  # not served
    assert ev == [] and e.path.read_bytes()[8:12] == (99).to_bytes(4, "little")  # not quarantined, not changed
    s2.clear()
    s2.gc()
    assert e.path.exists()  # neither clear nor gc deletes what this build cannot read


def test_identity_mismatch(tmp_path):
    s = CheckpointStore(tmp_path / "c")
    s.register_namespace("ns", dict(IDENTITY, artifact="b" * 64))
    commit(s, make_checkpoint(list(range(1, 21))), ns="other", identity=IDENTITY)
    commit(s, make_checkpoint(list(range(1, 21))), ns="ns", identity=dict(IDENTITY, artifact="b" * 64))
    s2, ev = _events(tmp_path)  # registers "ns" with IDENTITY: the ns file mismatches
    assert [x["reason"] for x in ev] == ["identity mismatch"]
    assert [e.namespace for e in s2.entries()] == ["other"]  # unregistered: kept, not served
    assert s2.find(list(range(1, 30)), "other") is None
    s2.register_namespace("other", IDENTITY)
    assert s2.find(list(range(1, 30)), "other").match_len == 20
    # a restore re-checks identity even if the index was built before a re-registration
    hit = s2.find(list(range(1, 30)), "other")
    s2._identities["other"] = {"artifact": "changed"}
    with pytest.raises(CheckpointUnavailable):
        restore(s2, hit)
    assert ev[-1]["reason"] == "identity mismatch"


def test_capacity_lru(tmp_path):
    s, ev = _events(tmp_path)
    cps = [make_checkpoint([1000 * i + j for j in range(20)], seed=i) for i in range(4)]
    entries = [commit(s, cp) for cp in cps[:3]]
    size = entries[0].file_bytes
    s.ssd_budget_bytes = 3 * size
    restore(s, s.find(list(cps[0].tokens) + [1], "ns"))  # entry 0 becomes most recent
    commit(s, cps[3])
    left = {e.tokens[0] for e in s.entries()}
    assert left == {0, 2000, 3000}  # entry 1 was least recently used
    assert ev[-1]["type"] == "evict" and ev[-1]["reason"] == "capacity"
    assert s.stats()["bytes"] <= 3 * size


def test_the_cap_evicts_in_chunks_of_short_transactions(tmp_path, monkeypatch):
    monkeypatch.setattr(capacity, "EVICT_CHUNK", 8)
    s = new_store(tmp_path)
    cps = [make_checkpoint([1000 * i + j for j in range(4)], layers=1, heads=1, head_dim=2, seed=i) for i in range(31)]
    entries = [commit(s, cp) for cp in cps[:30]]
    s.ssd_budget_bytes = budget = entries[0].file_bytes * 3 // 2  # room for one file
    s.catalog.holds = []
    commit(s, cps[30])
    labels = [label for label, _ in s.catalog.holds]
    assert labels.count("publish") == 1 and labels.count("evict") == 3, labels  # 29 go: 8 + 8 + 8 + 5
    assert [e.tokens[0] for e in s.entries()] == [30000]
    assert len(os.listdir(tmp_path / "ns")) == 1 and s.stats()["bytes"] <= budget


def test_supersession(tmp_path):
    s = new_store(tmp_path)
    base = list(range(1, 61))
    short = commit(s, make_checkpoint(base[:20]))
    other = commit(s, make_checkpoint(base[:10] + [5] * 10))
    mid = commit(s, make_checkpoint(base[:30]))
    assert not short.path.exists() and other.path.exists()  # 20 superseded by trimmable 30
    commit(s, make_checkpoint(base[:30], seed=3))  # exact duplicate replaced
    assert sorted(len(e) for e in s.entries()) == [20, 30]
    commit(s, make_checkpoint(base[:50]), trimmable=False)  # not trimmable: supersedes nothing
    assert sorted(len(e) for e in s.entries()) == [20, 30, 50]
    commit(s, make_checkpoint(base[:40]), min_reusable_offset=35)  # 30 < 35: keeps 30
    assert sorted(len(e) for e in s.entries()) == [20, 30, 40, 50]
    commit(s, make_checkpoint(base[:45]))
    assert sorted(len(e) for e in s.entries()) == [20, 45, 50]
    assert not mid.path.exists() and other.path.exists()
    assert s.stats()["files"] == 3 and len(os.listdir(tmp_path / "ns")) == 3


def test_other_process_commit_is_found_by_the_next_lookup(tmp_path):
    root = tmp_path / "c"
    s = new_store(root)
    script = IMPORTS + textwrap.dedent(f"""
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache
        s = CheckpointStore({str(root)!r})
        c = KVCache(); c.update_and_fetch(mx.ones((1, 2, 12, 8)), mx.ones((1, 2, 12, 8)))
        cp = Checkpoint.capture(list(range(1, 13)), [c])
        path = s.prepare_path("ns", cp.tokens)
        s.publish(fmt.write_checkpoint(path, identity={IDENTITY!r}, namespace="ns", tokens=cp.tokens,
                  layout=cp.layout(), min_reusable_offset=0, host_tensors=cp.host_tensors(), trimmable=True,
                  commit=s.commit))
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    hit = s.find(list(range(1, 20)), "ns")  # the next lookup sees it: no rescan, no delay
    assert hit is not None and hit.match_len == 12
    assert np.array_equal(np.array(restore(s, hit).arrays()[0]), np.ones((1, 2, 12, 8), np.float32))


def test_lookup_does_no_io_and_a_vanished_file_is_forgotten(tmp_path):
    s = new_store(tmp_path)
    e = commit(s, make_checkpoint(list(range(1, 11))))
    os.unlink(e.path)  # another process removed it
    hit = s.find(list(range(1, 20)), "ns")
    assert hit is not None  # the index answers without I/O
    with pytest.raises(CheckpointUnavailable):
        restore(s, hit)
    assert s.stats()["quarantined"] == 0 and s.entries() == []


def test_kill_during_large_write_leaves_previous_intact(tmp_path):
    root = tmp_path / "c"
    s = new_store(root)
    prev = make_checkpoint(list(range(1, 101)))
    commit(s, prev)
    # ~200 MB checkpoint; the child signals once the temp file has data, then
    # stalls in pause() (as during generation) until it is killed
    script = IMPORTS + textwrap.dedent(f"""
        import time
        import numpy as np
        class HT:
            def __init__(self, name, a): self.name, self.dtype, self.shape, self.array = name, "float32", a.shape, a
        n = 4096
        hts = [HT(f"layers.{{i}}.{{j}}", np.full((1, 4, n, 768), i, np.float32)) for i in range(8) for j in range(2)]
        layout = [{{"kind": "KVCache", "meta": {{"offset": n}}, "arrays": 2}} for _ in range(8)]
        s = CheckpointStore({str(root)!r})
        toks = list(range(1, 101)) + list(range(5000, 5000 + n - 100))
        state = {{"said": False}}
        def progress(done, total):
            if done >= 64 << 20 and not state["said"]:
                state["said"] = True
                print("WRITING", flush=True)
        def stall():
            while state["said"]:
                time.sleep(0.05)
        path = s.prepare_path("ns", toks)
        fmt.write_checkpoint(path, identity={IDENTITY!r}, namespace="ns", tokens=toks, layout=layout,
                             min_reusable_offset=0, host_tensors=hts, trimmable=True, progress=progress,
                             pause=stall)
        print("DONE", flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "WRITING"
        temps = [n for n in os.listdir(root / "ns") if n.startswith(".") and n.endswith(".tmp")]
        assert temps and os.path.getsize(root / "ns" / temps[0]) >= 64 << 20
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    s2 = new_store(root)
    [e] = s2.entries()  # the partial file is invisible
    assert e.tokens == prev.tokens
    hit = s2.find(list(range(1, 200)), "ns")
    assert hit.match_len == 100 and same_arrays(restore(s2, hit), prev)
    # the killed writer's temp file went with the restart (its process is gone)
    assert not [n for n in os.listdir(root / "ns") if n.endswith(".tmp")]
    # a live writer's temp file stays, unless it is over an hour old
    live, old = (root / "ns" / f".{'a' * 64}.ckpt.{os.getpid()}.{i}.tmp" for i in (1, 2))
    live.write_bytes(b"x")
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 7200,) * 2)
    new_store(root)
    assert live.exists() and not old.exists()


def test_directory_modes_and_namespace_validation(tmp_path):
    root = tmp_path / "c"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    s = new_store(root)
    commit(s, make_checkpoint([1, 2, 3]))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "ns").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root / "quarantine").st_mode) == 0o700
    for bad in ["../x", "", "a/b", "x" * 65, "quarantine", "é"]:
        with pytest.raises(ValueError):
            s.prepare_path(bad, [1])


def test_verify_all_remove_clear(tmp_path):
    s, ev = _events(tmp_path)
    a = commit(s, make_checkpoint(list(range(1, 21))))
    b = commit(s, make_checkpoint(list(range(100, 121))))
    h = fmt.read_header(b.path)
    with open(b.path, "r+b") as f:
        f.seek(h.tensors[0].offset)
        f.write(b"\x00\x01\x02\x03")
    bad = s.verify_all()
    assert [p for p, _ in bad] == [b.path] and "BLAKE3" in bad[0][1]
    assert [e.key for e in s.entries()] == [a.key]
    s.clear()
    assert s.entries() == [] and os.listdir(tmp_path / "c" / "ns") == [] and not a.path.exists()
    [evidence] = os.listdir(tmp_path / "c" / "quarantine")  # clear keeps what was found bad
    report = s.gc()  # evidence of corruption stays until the user clears it
    assert report["quarantine_removed"] == [] and report["quarantine_kept"] == 1
    report = s.gc(dry_run=True, quarantine=True)
    assert report["quarantine_removed"] == [str(tmp_path / "c" / "quarantine" / evidence)]
    assert os.listdir(tmp_path / "c" / "quarantine") == [evidence]  # a dry run deletes nothing
    assert s.gc(quarantine=True)["quarantine_removed"] == report["quarantine_removed"]
    assert os.listdir(tmp_path / "c" / "quarantine") == []
