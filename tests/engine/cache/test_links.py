"""Nothing outside the cache directory is ever touched (issue 49): a subdirectory of the cache
that is a symbolic link, there from the start or swapped in during a sweep, costs no file behind
it. One test per sweep (heartbeats, quarantine, blocks, temp files, names, namespaces, objects,
process reports), each with canary files outside that must survive, and the races: a directory
replaced by a link between a sweep's listing and its unlinks (the unlinks go to the directory
that was listed, through its descriptor) or between two steps (the next opening refuses)."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import mlx.core as mx
import pytest
from fault_worker import NS, open_store, read_bad, write

from mlxcache_kernel.engine import Engine, LinkedDirectory
from mlxcache_kernel.engine.admin.reports import ProcessReport
from mlxcache_kernel.engine.cache import faults
from mlxcache_kernel.engine.cache.catalog.liveness import DEAD_AFTER_S, HEARTBEAT_S, MISSES
from mlxcache_kernel.engine.cache.ssd import blocks
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
from mlxcache_kernel.engine.errors import CheckpointNameError
from mlxcache_kernel.engine.host import safe_dirs
from mlxcache_kernel.engine.named.checkpoints import NamedCheckpoints
from mlxcache_kernel.magics.tables import stat_lines

DEAD_TAG = "deadbeef0000"  # a process tag no live process has: its temp files are stale
OLD = time.time() - 7200  # older than any age rule (STALE_TEMP_S, KEEP_DEAD_S)


def canaries(d: Path, names: list[str]) -> dict[str, bytes]:
    """Files a user keeps in `d` (outside the cache), two hours old; d is 0755."""
    d.mkdir(parents=True, exist_ok=True)
    d.chmod(0o755)
    kept = {}
    for name in names + ["notes.txt"]:
        kept[name] = f"canary {name}".encode()
        (d / name).write_bytes(kept[name])
        os.utime(d / name, (OLD, OLD))
    return kept


def intact(d: Path, kept: dict[str, bytes]) -> None:
    assert {n: (d / n).read_bytes() for n in os.listdir(d)} == kept, "a file outside the cache was touched"
    assert (d.stat().st_mode & 0o777) == 0o755, "the mode of a directory outside the cache changed"


def link(path: Path, target: Path) -> Path | None:
    """Put a symbolic link to `target` at `path`; the directory that was there moves aside (returned)."""
    aside = None
    if path.exists():
        aside = path.with_name(path.name + ".aside")
        path.rename(aside)
    os.symlink(target, path)
    return aside


def observing(point: str, action):
    """Run `action()` the first time the store reaches fault point `point` (faults.observe)."""
    done = []

    def seen(p, _db):
        if p == point and not done:
            done.append(p)
            action()
    faults.observe(seen)
    return done


@pytest.fixture(autouse=True)
def _stop_observing():
    yield
    faults.observe(None)


def temp_name(block: bool = False) -> str:
    return f".{'7' * 64}{'.blk' if block else '.ckpt'}.{DEAD_TAG}.1.tmp"


# --- the safe directory primitives ---


def test_make_private_dir_never_changes_a_links_target(tmp_path):
    root, outside = tmp_path / "cache", tmp_path / "elsewhere"
    kept = canaries(outside, [])
    root.mkdir()
    link(root / "names", outside)
    with pytest.raises(LinkedDirectory, match="symbolic link"):
        safe_dirs.make_private_dir(root / "names", root)
    with pytest.raises(LinkedDirectory):  # a link further up is caught as well
        safe_dirs.make_private_dir(root / "names" / "deeper", root)
    intact(outside, kept)
    assert not (outside / "deeper").exists()
    assert str(root / "names") in safe_dirs.found(root)
    (root / "plain").mkdir(mode=0o755)
    safe_dirs.make_private_dir(root / "plain", root)
    assert (root / "plain").stat().st_mode & 0o777 == 0o700
    os.unlink(root / "names")
    safe_dirs.make_private_dir(root / "names", root)  # a real directory now: used, no longer listed
    assert str(root / "names") not in safe_dirs.found(root)


def test_the_cache_directory_itself_may_be_a_link(tmp_path):
    """Where the user put the cache: it is followed, and used with its SSD tier."""
    real = tmp_path / "disk" / "cache"
    real.mkdir(parents=True)
    link(tmp_path / "cache", real)
    with Engine(cache_dir=tmp_path / "cache") as eng:
        assert eng.objects.put(("k", 1), mx.arange(4))
        eng.flush()
        s = eng.stats()
        assert s["ssd_enabled"] and s["ssd_disabled_reason"] is None and s["cache_links"] == {}
    assert list((real / "checkpoints").glob("obj-*/*.ckpt"))


# --- heartbeats ---


def test_heartbeats_a_link_from_the_start_leaves_the_tier_off(tmp_path):
    cache, outside = tmp_path / "cache", tmp_path / "elsewhere"
    kept = canaries(outside, ["0123456789abcdef"])
    (cache / "checkpoints").mkdir(parents=True)
    link(cache / "checkpoints" / ".heartbeats", outside)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Engine(cache_dir=cache) as eng:
            s = eng.stats()
            lines = "\n".join(stat_lines(s))
    assert not s["ssd_enabled"] and ".heartbeats" in s["ssd_disabled_reason"] and "RAM-only" in s["ssd_disabled_reason"]
    assert s["cache_links"] == {str(cache / "checkpoints" / ".heartbeats"): f"a symbolic link (to {outside})"}
    assert f"{cache / 'checkpoints' / '.heartbeats'} is a symbolic link (to {outside})" in lines
    said = [str(w.message) for w in seen if ".heartbeats" in str(w.message)]
    assert len(said) == 2 and "RAM-only" in said[1], said  # the link, once; the tier off, by the engine
    intact(outside, kept)


def test_heartbeats_swapped_for_a_link_lose_nothing_to_the_sweep_of_the_dead(root, tmp_path):
    """The keeper's sweep removes heartbeat files no registered process owns once they stop
    changing: first shown on a real one, then the directory becomes a link to a user's files."""
    now = [0.0]
    s = open_store(root, clock=lambda: now[0])
    try:
        def age():
            for _ in range(2 * MISSES + 2):
                now[0] += max(HEARTBEAT_S, DEAD_AFTER_S / MISSES)
                s.maintain()
        (root / ".heartbeats" / "fedcba9876543210").write_bytes(b"\0" * 8)
        age()
        assert not (root / ".heartbeats" / "fedcba9876543210").exists(), "the sweep did not run"
        outside = tmp_path / "elsewhere"
        kept = canaries(outside, ["0123456789abcdef", "photo.jpg"])
        link(root / ".heartbeats", outside)
        age()
        s.gc()
        intact(outside, kept)
        assert str(root / ".heartbeats") in safe_dirs.found(root.parent)
    finally:
        s.close()
    intact(outside, kept)


# --- quarantine ---


def test_quarantine_a_link_gc_removes_nothing_and_bad_files_stay_put(root, tmp_path):
    outside = tmp_path / "elsewhere"
    kept = canaries(outside, ["evidence.old", f"block.{'a' * 64}.1"])
    link(root / "quarantine", outside)
    from fault_worker import bad_block

    bad = blocks.block_path(root / "blocks", bad_block(root))
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2] ^= 0x5A
    bad.write_bytes(bytes(raw))
    events = []
    s = open_store(root, on_event=events.append)  # the tier runs without its quarantine
    try:
        read_bad(s, "C")  # a miss; the bad block cannot move aside (it goes, as a freed block does)
        assert any(e["type"] == "quarantine_failed" and "symbolic link" in e["error"] for e in events)
        r = s.gc(quarantine=True)
        assert r["quarantine_removed"] == [] and r["quarantine_kept"] == 0
        assert str(root / "quarantine") in safe_dirs.found(root.parent)
    finally:
        s.close()
    intact(outside, kept)


def test_quarantine_swapped_for_a_link_during_gc(root, tmp_path):
    """gc lists the evidence, then reconciles, then removes it: the directory becomes a link in
    between, to files of the same names: none of them goes."""
    outside = tmp_path / "elsewhere"
    kept = canaries(outside, sorted(os.listdir(root / "quarantine")))
    s = open_store(root)
    try:
        swapped = observing("reconcile.begin", lambda: link(root / "quarantine", outside))
        r = s.gc(quarantine=True)
        assert swapped and r["quarantine_removed"] == [str(root / "quarantine" / "evidence.old")]
    finally:
        s.close()
    intact(outside, kept)
    assert os.listdir(root / "quarantine.aside") == ["evidence.old"]  # (not removed either: the opening refused)


# --- blocks ---


def test_blocks_a_link_from_the_start_leaves_the_tier_off(root, tmp_path):
    outside = tmp_path / "elsewhere"
    kept = canaries(outside, [f"{'a' * 64}.blk", temp_name(block=True)])
    link(root / "blocks", outside)
    with pytest.raises(LinkedDirectory, match="blocks is a symbolic link"):
        CheckpointStore(root)
    intact(outside, kept)


def test_blocks_swapped_for_a_link_lose_nothing_to_reconcile_gc_or_writes(root, tmp_path):
    """An uncatalogued <64 hex>.blk and an old temp file behind the link: reconcile and the
    stale-temp rule would remove both; a write refuses to put anything there."""
    outside = tmp_path / "elsewhere"
    kept = canaries(outside, [f"{'a' * 64}.blk", temp_name(block=True), f".{'b' * 64}.blk.123.tmp"])
    s = open_store(root)
    try:
        link(root / "blocks", outside)
        s.gc()
        s._reconcile()
        with pytest.raises(OSError):
            write(s, "E")
    finally:
        s.close()
    intact(outside, kept)


# --- temp files: the race between listing and unlinking ---


@pytest.mark.parametrize("where", ["blocks", NS])
def test_a_directory_swapped_for_a_link_between_listing_and_unlinking(root, tmp_path, where):
    """The stale-temp sweep lists a directory, then unlinks what is stale: the directory is
    replaced by a link in between, to a file of the very name it is about to remove. The
    unlink goes to the directory that was listed (through its descriptor), not behind the link."""
    d = root / where
    name = temp_name(block=where == "blocks")
    outside = tmp_path / "elsewhere"
    kept = canaries(outside, [name])
    s = open_store(root)
    try:
        (d / name).write_bytes(b"half a write")  # (after the opening: it would sweep it)
        swapped = observing("stale.unlink", lambda: link(d, outside))
        s.gc()
        assert swapped, "the sweep did not reach its unlinks"
    finally:
        s.close()
    intact(outside, kept)
    assert not (root / f"{where}.aside" / name).exists(), "the listed directory's stale temp stayed"


# --- names ---


def test_names_a_link_names_are_off_and_nothing_behind_it_changes(tmp_path):
    cache, outside = tmp_path / "cache", tmp_path / "elsewhere"
    kept = canaries(outside, ["a.json"])
    cache.mkdir()
    link(cache / "names", outside)
    with Engine(cache_dir=cache, ssd=False) as eng:
        assert str(cache / "names") in eng.stats()["cache_links"]
    names = NamedCheckpoints(cache / "names")
    assert names.list() == []
    with pytest.raises(CheckpointNameError, match="see %cache stats"):
        names.save("b", {"namespace": "ns", "tokens": [1]})
    intact(outside, kept)


def test_names_swapped_for_a_link_are_neither_listed_nor_removed(tmp_path):
    cache, outside = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    names = NamedCheckpoints(cache / "names")
    names.save("a", {"namespace": "ns", "tokens": [1]})
    kept = canaries(outside, [])
    kept["a.json"] = b'{"name": "a", "namespace": "ns", "tokens": [1]}'
    (outside / "a.json").write_bytes(kept["a.json"])
    link(cache / "names", outside)
    assert names.list() == []
    with pytest.raises(CheckpointNameError, match="could not be removed"):
        names.remove("a")
    with pytest.raises(OSError):
        names.save("c", {"namespace": "ns", "tokens": [2]})
    intact(outside, kept)


# --- namespaces and objects ---


def test_a_namespace_that_is_a_link_is_neither_reconciled_nor_swept(root, tmp_path):
    """A bad checkpoint file behind the link would be quarantined (moved out) and a dead
    writer's temp removed, were the link followed."""
    outside = tmp_path / "elsewhere"
    kept = canaries(outside, [f"{'d' * 64}.{'e' * 8}.ckpt", temp_name()])
    link(root / "other-ns", outside)
    s = open_store(root)
    try:
        s.gc(quarantine=True)
        assert str(root / "other-ns") in safe_dirs.found(root.parent)
    finally:
        s.close()
    intact(outside, kept)


def test_an_object_namespace_moved_behind_a_link_loses_nothing_to_delete_clear_or_gc(tmp_path):
    cache, outside = tmp_path / "cache", tmp_path / "elsewhere"
    with Engine(cache_dir=cache) as eng:
        eng.objects.put(("doc", 1), mx.arange(8))
        eng.objects.put(("doc", 2), mx.arange(9))
        eng.flush()
    dirs = sorted((cache / "checkpoints").glob("obj-*"))
    assert len(dirs) == 2
    kept = canaries(outside, [])
    for d in dirs:  # a user moves the objects to another disk and links them back
        os.rename(d, outside / d.name)
        link(d, outside / d.name)
    before = {str(p.relative_to(outside)): p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    with Engine(cache_dir=cache) as eng:
        eng.objects.delete(("doc", 1))
        eng.objects.clear()
        eng.admin.gc(quarantine=True)
        assert {str(d) for d in dirs} <= set(eng.stats()["cache_links"])
    after = {str(p.relative_to(outside)): p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    assert after == before and {k: v for k, v in after.items() if "/" not in k} == kept


# --- process reports ---


def test_process_reports_behind_a_link_are_not_forgotten(tmp_path):
    """An engine's first report removes the reports of dead processes: never behind a link."""
    cache, outside = tmp_path / "cache", tmp_path / "elsewhere"
    kept = canaries(outside, ["0123456789abcdef.json"])
    cache.mkdir()
    link(cache / "processes", outside)
    with Engine(cache_dir=cache) as eng:
        report = ProcessReport(eng)
        assert not report.maybe_write()
        report._forget_the_dead()
        report.remove()
    intact(outside, kept)
