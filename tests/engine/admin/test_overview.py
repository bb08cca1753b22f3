"""The directory overview (engine/admin/overview.py) and its read-only catalogue reader in hostile
states: each one a state with a message, never an exception, and nothing written."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxcache_kernel.engine.cache.catalog.tables import Catalog, FileRow
from mlxcache_kernel.engine.admin.overview import DirectoryOverview

KEY = "ab" * 32


def make_catalog(cache_dir: Path, n: int = 3, ns: str = "model-ns") -> Catalog:
    """A catalogue of n files (no bytes on disk: the overview reads only the catalogue), written by us."""
    (cache_dir / "checkpoints").mkdir(parents=True, mode=0o700, exist_ok=True)
    os.chmod(cache_dir, 0o700)
    cat = Catalog(cache_dir / "checkpoints" / "catalog.db")
    with cat.transaction("test") as db:
        for i in range(n):
            cat.add_file(db, FileRow(ns, f"{i:064x}", str(cache_dir / "checkpoints" / ns / f"{i}.ckpt"),
                                     tuple(range(10 + i)), 100 + i, 1000 + i, 0, True, 2, time.time(), time.time() + i,
                                     {}), written=True)
    return cat


def snapshot_without_writes(cache_dir: Path, **kw) -> dict:
    """The overview, checking it changed nothing in the directory."""
    def listing():
        return sorted((str(p.relative_to(cache_dir)), p.stat().st_size, p.stat().st_mtime_ns)
                      for p in cache_dir.rglob("*") if p.is_file() and not p.name.endswith(("-shm", "-wal")))

    before = listing() if cache_dir.exists() else None
    out = DirectoryOverview(cache_dir).snapshot(**kw)
    assert (listing() if cache_dir.exists() else None) == before
    json.dumps(out)  # plain data
    return out


def test_ok_directory_rows_totals_and_writer(tmp_path):
    cat = make_catalog(tmp_path, 3)
    try:
        o = snapshot_without_writes(tmp_path)
        assert o["state"] == "ok" and o["schema"] == 4 and o["ssd"]["files"] == 3
        [me] = o["processes"]
        assert me["alive"] and me["pid"] == os.getpid() and me["files"] == 3
        page = o["page"]
        assert [f["key"] for f in page["files"]] == [f"{i:064x}" for i in (2, 1, 0)]  # last used first
        assert all(f["writer"]["pid"] == os.getpid() and f["writer"]["alive"] for f in page["files"])
        small = DirectoryOverview(tmp_path).snapshot(sort="tokens", descending=False, limit=2, offset=1)["page"]
        assert [f["tokens"] for f in small["files"]] == [11, 12] and small["matching"] == 3
        assert DirectoryOverview(tmp_path).snapshot(query="%")["page"]["matching"] == 0  # LIKE wildcards escaped
        view = DirectoryOverview(tmp_path)
        assert view.snapshot()["page"]["matching"] == 3 and view.snapshot()["page"]["matching"] == 3
        with cat.transaction("test") as db:  # another connection commits: the next snapshot reads again
            cat.drop_file(db, "model-ns", f"{0:064x}")
        again = view.snapshot()
        assert again["page"]["matching"] == 2 and again["ssd"]["files"] == 2 and again["processes"][0]["files"] == 2
        with pytest.raises(ValueError, match="unknown sort"):
            DirectoryOverview(tmp_path).snapshot(sort="f.key")
        with pytest.raises(ValueError, match="invalid model namespace"):
            DirectoryOverview(tmp_path).snapshot("x' OR 1=1 --")
    finally:
        cat.close()


def test_missing_and_empty_directories(tmp_path):
    o = snapshot_without_writes(tmp_path / "nope")
    assert o["state"] == "missing" and not (tmp_path / "nope").exists()
    (tmp_path / "fresh").mkdir(mode=0o700)
    o = snapshot_without_writes(tmp_path / "fresh")
    assert o["state"] == "empty" and "no SSD tier" in o["message"] and o["processes"] == []


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to make another user's dir")
def test_another_users_directory_is_not_read(tmp_path):
    cat = make_catalog(tmp_path / "theirs")
    cat.close()
    os.chown(tmp_path / "theirs", 4242, 4242)
    o = snapshot_without_writes(tmp_path / "theirs")
    assert o["state"] == "foreign" and "uid 4242" in o["message"] and "page" not in o and "names" not in o


def test_a_directory_others_may_read_is_a_warning(tmp_path):
    cat = make_catalog(tmp_path / "c")
    try:
        os.chmod(tmp_path / "c", 0o755)
        o = DirectoryOverview(tmp_path / "c").snapshot()
        assert o["state"] == "ok" and "readable by other users" in o["warnings"][0]
    finally:
        cat.close()


def test_a_damaged_catalogue_is_a_state_and_left_alone(tmp_path):
    db = tmp_path / "checkpoints" / "catalog.db"
    db.parent.mkdir(parents=True)
    db.write_bytes(b"this is not a database, " * 200)
    o = snapshot_without_writes(tmp_path)
    assert o["state"] == "corrupt" and "rebuilds the catalogue" in o["message"]
    assert db.read_bytes().startswith(b"this is not a database")


def test_a_locked_catalogue_is_busy_and_asked_again(tmp_path):
    cat = make_catalog(tmp_path)
    cat.close()
    path = tmp_path / "checkpoints" / "catalog.db"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        f"c = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
        "c.execute('PRAGMA locking_mode=EXCLUSIVE'); c.execute('BEGIN EXCLUSIVE')\n"
        "c.execute(\"UPDATE meta SET v=v WHERE k='schema'\")\n"
        "print('locked', flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        o = DirectoryOverview(tmp_path).snapshot()
        assert o["state"] == "busy" and o["retry_s"] > 0 and "asking again" in o["message"]
        assert time.monotonic() - t0 < 5  # a bounded wait, never the holder's pleasure
    finally:
        holder.kill()
        holder.wait()
    assert DirectoryOverview(tmp_path).snapshot()["state"] == "ok"  # and the next try reads it


HOLD_A_WRITE = """
import sys, time
from mlxcache_kernel.engine.cache.catalog.tables import Catalog
cat = Catalog(__import__('pathlib').Path(sys.argv[1]))
cat.reserve_blocks(["cd" * 32], write_id=7)  # a write that claimed its blocks, not committed
print("claimed", flush=True)
time.sleep(600)
"""


def test_a_process_killed_mid_write(tmp_path):
    cat = make_catalog(tmp_path)
    cat.close()
    child = subprocess.Popen([sys.executable, "-c", HOLD_A_WRITE, str(tmp_path / "checkpoints" / "catalog.db")],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "claimed"
    o = DirectoryOverview(tmp_path).snapshot()
    writer = next(p for p in o["processes"] if p["pid"] == child.pid)
    assert writer["alive"] and writer["writing"] == 1
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    o = snapshot_without_writes(tmp_path)  # no live peer swept it yet: the overview says what is left
    dead = next(p for p in o["processes"] if p["pid"] == child.pid)
    assert not dead["alive"] and dead["writing"] == 1 and dead["in_catalogue"]
    gone = next(p for p in o["processes"] if p["pid"] == os.getpid())  # the closed writer of the 3 files
    assert not gone["alive"] and gone["files"] == 3 and not gone["in_catalogue"]


def test_reports_and_names_that_are_torn_or_foreign_are_skipped(tmp_path):
    cat = make_catalog(tmp_path)
    try:
        reports, names = tmp_path / "processes", tmp_path / "names"
        reports.mkdir()
        names.mkdir()
        (reports / f"{cat.owner}.json").write_text('{"owner": "' + cat.owner + '", "pid": 1, "entries": [')
        (reports / "someone.json").write_text(json.dumps({"owner": "not-someone"}))
        (names / "bad.json").write_text("{")
        (names / "ok.json").write_text(json.dumps({"name": "ok", "namespace": "model-ns", "tokens": [1, 2]}))
        o = snapshot_without_writes(tmp_path)
        assert o["state"] == "ok" and o["reports"] == 0 and [n["name"] for n in o["names"]] == ["ok"]
    finally:
        cat.close()
