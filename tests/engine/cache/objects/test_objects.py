"""Engine.objects: exact-key tensor objects on the RAM and SSD tiers (issue 21)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from object_values import assert_same, every_kind, fingerprint
from repo_paths import SUPPORT

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.cache.objects import cache as objects_mod
from mlxcache_kernel.engine.cache.objects.cache import ObjectValue, namespace_of
from mlxcache_kernel.engine.cache.objects.values import Unkeyable, Unstorable, digest



@pytest.fixture
def cache_dir(tmp_path):
    return tmp_path / "cache"


def test_round_trip_every_kind_in_ram_and_from_ssd(cache_dir):
    value = every_kind()
    with Engine(cache_dir=cache_dir) as eng:
        assert eng.objects.get(("every", 1)) is None and eng.objects.where(("every", 1)) is None
        assert eng.objects.put(("every", 1), value)
        assert eng.objects.where(("every", 1)) == "ram"
        assert_same(value, eng.objects.get(("every", 1)))
        eng.flush()
        assert eng.stats()["object_ssd_files"] == 1
    with Engine(cache_dir=cache_dir) as eng:  # a new engine: nothing in RAM
        assert eng.objects.where(("every", 1)) == "ssd"
        got, source = eng.objects.lookup(("every", 1))
        assert source == "ssd"
        assert_same(value, got)
        s = eng.stats()
        assert s["object_ssd_hits"] == 1 and s["object_ram_entries"] == 1
        assert eng.objects.where(("every", 1)) == "ram" and eng.objects.lookup(("every", 1))[1] == "ram"
        assert eng.objects.lookup(("every", 2)) == (None, None)
        for top in (mx.arange(3), np.arange(3.0), [], {}, (), None, "only a string"):  # leaves and empties alone
            eng.objects.put(("top", repr(top)), top)
        eng.flush()
    with Engine(cache_dir=cache_dir) as eng:
        for top in (mx.arange(3), np.arange(3.0), [], {}, (), None, "only a string"):
            assert_same(top, eng.objects.get(("top", repr(top)), default="missing"))


def test_keys_are_exact_and_typed(cache_dir):
    with Engine(cache_dir=cache_dir, ssd=False) as eng:
        keys = ["1", b"1", 1, 1.0, True, (1,), [1], {"a": 1}, np.array([1]), np.array([1], np.int32),
                np.int64(1), mx.array([1]), mx.array([1], dtype=mx.int64), np.array([[1]])]
        for i, k in enumerate(keys):
            eng.objects.put(k, mx.array([i]))
        for i, k in enumerate(keys):
            assert eng.objects.get(k).item() == i, k
        assert eng.objects.get({"b": 2, "a": 1}) is None
        eng.objects.put({"b": 2, "a": 1}, mx.array([99]))
        assert eng.objects.get({"a": 1, "b": 2}).item() == 99  # a dict key by its items, not their order
        with pytest.raises(Unkeyable, match=r"key\[1\] is of type object"):
            eng.objects.put(("ok", object()), mx.array([1]))
        with pytest.raises(Unkeyable):
            eng.objects.get(np.array([object()], dtype=object))


def test_unsupported_values_are_clear_errors_that_store_nothing(cache_dir):
    with Engine(cache_dir=cache_dir, ssd=False) as eng:
        for bad, where in ((object(), "value"), ({"a": [1, {2, 3}]}, r"value\['a'\]\[1\]"),
                           ({(1, 2): mx.ones(1)}, "key of type tuple"), (np.array([None], object), "dtype object")):
            with pytest.raises(Unstorable, match=where):
                eng.objects.put("bad", bad)
        assert eng.objects.get("bad") is None and eng.stats()["object_puts"] == 0
        with pytest.raises(ValueError, match="label"):
            eng.objects.put("k", mx.ones(1), label="x" * 500)


def test_reads_lend_immutable_arrays(cache_dir):
    """Nothing the caller does to its arrays, and no eviction, changes what the other side holds."""
    with Engine(cache_dir=cache_dir) as eng:
        src_np, src_mx = np.arange(6.0), mx.arange(6, dtype=mx.float32)
        eng.objects.put("k", {"np": src_np, "mx": src_mx})
        src_np[0] = 100.0  # the producer changes its arrays after the put
        src_mx[0] = 100.0
        got = eng.objects.get("k")
        assert got["np"][0] == 0.0 and got["mx"][0].item() == 0.0
        assert not got["np"].flags.writeable
        with pytest.raises(ValueError):
            got["np"].flags.writeable = True
        with pytest.raises(ValueError):
            got["np"][0] = 5.0
        got["mx"][1] = 50.0  # rebinds the caller's array object only
        again = eng.objects.get("k")
        assert again["mx"][1].item() == 1.0 and again["np"][1] == 1.0
        eng.flush()
        assert eng.objects.delete("k") and eng.objects.get("k") is None  # gone from RAM and SSD
        eng.cache_clear(ssd=True)
        mx.eval(mx.zeros((1 << 20,)))  # new allocations may reuse freed buffers: not these
        assert again["np"].tolist() == list(np.arange(6.0)) and again["mx"].tolist() == [0, 1, 2, 3, 4, 5]
    with Engine(cache_dir=cache_dir) as eng:
        assert eng.objects.get("k") is None
    with pytest.raises(RuntimeError, match="closed"):
        eng.objects.get("k")


def test_an_object_never_serves_as_a_prefix(cache_dir, tiny_model_dir):
    with Engine(cache_dir=cache_dir) as eng:
        eng.load_model(tiny_model_dir)
        ns_model = eng.models.get().namespace
        eng.objects.put("doc", mx.ones((4, 8)))
        obj = eng.cache.get_exact((), namespace_of(digest("doc"))).checkpoint
        assert isinstance(obj, ObjectValue) and not any(obj.can_serve(n) for n in range(5))
        assert not namespace_of(digest("doc")).startswith(ns_model)
        r = eng.generate("hello objects", max_tokens=3)
        assert r.stats["cached_tokens"] == 0 and r.stats["cache_source"] is None
        eng.flush()
        assert eng.cache.store.find(r.tokens, namespace_of(digest("doc"))) is None
        kinds = sorted(e["kind"] for e in eng.admin.entries())
        assert kinds[0] == "object" and "prefix" in kinds


def test_put_again_replaces_the_value_everywhere(cache_dir):
    with Engine(cache_dir=cache_dir, write_behind=False) as eng:
        eng.objects.put("k", mx.array([1]), label="first")
        eng.flush()
        eng.objects.put("k", mx.array([2]), label="second")  # not written yet (write-behind off)
        assert eng.cache.reclaim(1 << 40) == 0  # not durable: stays in RAM, its write queued
        assert eng.objects.get("k").item() == 2
        eng.flush()
        assert eng.cache.reclaim(1 << 40) > 0  # durable now: it may go
        assert eng.objects.where("k") == "ssd" and eng.objects.get("k").item() == 2
        assert [e["label"] for e in eng.objects.entries()] == ["second"]


def test_persist_before_evict_under_a_small_ram_budget(cache_dir):
    mb = 1 << 20
    values = {i: mx.full((mb // 4,), float(i)) for i in range(6)}  # 1 MiB each, 2.5 MiB of RAM
    with Engine(cache_dir=cache_dir, ram_budget_bytes=int(2.5 * mb)) as eng:
        for i, v in values.items():
            eng.objects.put(("v", i), v)
            for j in range(i + 1):  # never lost: in RAM until its SSD copy is committed
                assert eng.objects.where(("v", j)) is not None
        eng.flush()
        s = eng.stats()
        assert s["object_ssd_files"] == 6 and s["object_ram_bytes"] <= int(2.5 * mb)
        assert s["demotions"] >= 3
        for i, v in values.items():
            assert mx.array_equal(eng.objects.get(("v", i)), v).item()


def file_of(eng, key) -> Path:
    return Path(eng.cache.store.index.entries[(namespace_of(digest(key)), objects_mod._FILE_KEY)].path)


def flip_byte(path: Path, at: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF  # inside the last chunk's bytes
    path.write_bytes(bytes(data))


def test_corrupt_object_chunk_is_a_miss_and_quarantined(cache_dir):
    value = {"a": mx.arange(10, dtype=mx.float32), "b": np.ones(1 << 20, np.uint8)}  # b: chunks of 4 MiB max
    with Engine(cache_dir=cache_dir) as eng:
        eng.objects.put("k", value)
        eng.flush()
        path = file_of(eng, "k")
    flip_byte(path)
    with Engine(cache_dir=cache_dir) as eng:
        assert eng.objects.where("k") == "ssd"
        assert eng.objects.get("k") is None
        s = eng.stats()
        assert s["object_restore_failures"] == 1 and s["object_misses"] == 1 and s["ssd_quarantined"] == 1
        assert eng.objects.where("k") is None and not path.exists()
        assert any(path.name in p.name for p in (cache_dir / "checkpoints" / "quarantine").iterdir())
        eng.objects.put("k", value)  # computed again
        eng.objects.put("other", value)
        eng.flush()
        assert eng.cache_gc(quarantine=True)["quarantine_removed"] and eng.objects.where("k") == "ram"  # keeps good ones
        path = file_of(eng, "k")
    flip_byte(path)
    with Engine(cache_dir=cache_dir) as eng:
        bad = eng.cache_verify()  # %cache verify re-hashes objects too
        assert [b["path"] for b in bad] == [str(path)] and eng.objects.where("k") is None
        assert_same(value, eng.objects.get("other"))


def test_delete_clear_and_listing(cache_dir):
    with Engine(cache_dir=cache_dir) as eng:
        eng.objects.put(("enc", 1), mx.ones((2, 3)))
        eng.objects.put(("enc", 2), mx.ones((4,)))
        eng.objects.put("other", np.zeros(2), label="mine")
        eng.flush()
        rows = {r["label"]: r for r in eng.objects.entries()}
        assert set(rows) == {"enc", "mine"} and rows["mine"]["tier"] == "ram+ssd"
        assert rows["enc"]["preview"].startswith("enc · float32[") and rows["mine"]["kv_bytes"] == 16
        assert eng.objects.clear(label="enc") == 2
        assert eng.objects.get(("enc", 1)) is None and eng.objects.get("other") is not None
        assert eng.objects.delete("other") and not eng.objects.delete("other")
        assert eng.objects.entries() == [] and eng.stats()["object_ssd_files"] == 0


WORKER = textwrap.dedent("""
    import json, sys
    import mlx.core as mx, numpy as np
    sys.path.insert(0, {support!r})
    from object_values import every_kind, fingerprint
    from mlxcache_kernel.engine import Engine
    role, cache_dir = sys.argv[1], sys.argv[2]
    with Engine(cache_dir=cache_dir) as eng:
        if role.startswith("put"):
            eng.objects.put(("shared",), every_kind())
            eng.objects.put(("own", role), mx.full((1000,), float(len(role))))
            eng.flush()
            print(json.dumps({{"ok": True}}))
        else:
            got = {{k: eng.objects.get(k) for k in [("shared",), ("own", "put-a"), ("own", "put-bb")]}}
            print(json.dumps({{"shared": fingerprint(got[("shared",)]),
                              "a": got[("own", "put-a")].tolist()[:2], "bb": got[("own", "put-bb")].tolist()[:2],
                              "ssd_hits": eng.stats()["object_ssd_hits"]}}))
""")


def _worker(tmp_path) -> Path:
    path = tmp_path / "objects_worker.py"
    path.write_text(WORKER.format(support=str(SUPPORT)))
    return path


def test_processes_share_objects_through_the_directory(cache_dir, tmp_path):
    """Two processes put at once (one key each and one key both); a third, new process reads all from SSD."""
    worker = _worker(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(SUPPORT)}
    procs = [subprocess.Popen([sys.executable, str(worker), role, str(cache_dir)], stdout=subprocess.PIPE, text=True,
                              env=env) for role in ("put-a", "put-bb")]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0 and json.loads(out.splitlines()[-1])["ok"]
    got = subprocess.run([sys.executable, str(worker), "get", str(cache_dir)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert got.returncode == 0, got.stderr
    got = json.loads(got.stdout.splitlines()[-1])
    assert got == {"shared": fingerprint(every_kind()), "a": [5.0, 5.0], "bb": [6.0, 6.0], "ssd_hits": 3}


def test_dashboard_shows_objects_next_to_prefixes(cache_dir, tiny_model_dir):
    from mlxcache_kernel.widgets import ResidencyDashboard
    from mlxcache_kernel.widgets.dashboard_render import ram_label, render_entries

    with Engine(cache_dir=cache_dir) as eng:
        eng.load_model(tiny_model_dir)
        eng.generate("a prefix", max_tokens=2)
        eng.objects.put(("memo-like", 1), mx.ones((3, 4)), label="memo:embed")
        eng.objects.get(("memo-like", 1))
        eng.objects.get(("memo-like", 2))
        dash = ResidencyDashboard(eng, schedule=lambda fn: fn())
        html = dash.entries_html.value
        assert "mlxc-kind-object" in html and "object · memo:embed · float32[3x4]" in html and "mlxc-kind-prefix" in html
        assert dash.counters["object_hits"] == 1 and dash.counters["object_misses"] == 1
        assert "1 object" in ram_label(eng.stats())
        assert "no cached prefixes or objects" in render_entries([])
        dash.close()


def test_another_revisions_object_is_a_miss_then_replaced(cache_dir, monkeypatch):
    with Engine(cache_dir=cache_dir) as eng:
        eng.objects.put("k", mx.array([1]))
    monkeypatch.setattr(objects_mod, "REVISION", objects_mod.REVISION + 1)  # a later build's layout
    with Engine(cache_dir=cache_dir) as eng:
        assert eng.objects.where("k") is None and eng.objects.get("k") is None
        assert eng.stats()["ssd_quarantined"] == 0  # not corrupt: left until replaced
        eng.objects.put("k", mx.array([2]))
    with Engine(cache_dir=cache_dir) as eng:
        assert eng.objects.get("k").item() == 2 and eng.stats()["object_ssd_files"] == 1


def test_an_object_larger_than_ram_without_ssd_is_not_kept(cache_dir):
    with Engine(cache_dir=cache_dir, ssd=False, ram_budget_bytes=1000) as eng:
        assert eng.objects.put("small", mx.ones((10,)))
        assert not eng.objects.put("big", mx.ones((1000,)))  # 4 kB over a 1 kB budget, nowhere else to go
        assert eng.objects.get("big") is None and eng.objects.get("small") is not None
