"""The MLX Cache panel's server extension (mlxcache_kernel/panel/) in a real Jupyter server, over a
cache directory written by two real kernel processes: what each holds and wrote, its pins, the
rules of pin / unpin / delete, and a killed kernel's leftovers."""

from __future__ import annotations

import sqlite3
import time

import pytest
from panel_server import PanelServer

WAIT_S = 60


def wait_for(fetch, check, what: str, timeout: float = WAIT_S):
    """fetch() until check(value); the last value (a kernel's report follows its poll, once a second)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if check(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {value}")
        time.sleep(0.3)


def proc(overview: dict, pid: int) -> dict | None:
    return next((p for p in overview.get("processes") or () if p["pid"] == pid), None)


def catalog_pins(cache_dir) -> dict:
    db = sqlite3.connect(f"file:{cache_dir / 'checkpoints' / 'catalog.db'}?mode=ro", uri=True)
    try:
        return {name: (ns, key) for name, ns, key in db.execute("SELECT name, namespace, key FROM pins")}
    finally:
        db.close()


def catalog_has(cache_dir, key: str) -> bool:
    db = sqlite3.connect(f"file:{cache_dir / 'checkpoints' / 'catalog.db'}?mode=ro", uri=True)
    try:
        return db.execute("SELECT 1 FROM files WHERE key=?", (key,)).fetchone() is not None
    finally:
        db.close()


@pytest.fixture
def server(kernel_env, tmp_path):
    s = PanelServer(tmp_path / "cache", tmp_path / "server")
    yield s
    s.close()


def test_a_directory_no_kernel_used_yet_is_a_state(server, tmp_path):
    o = server.get()
    assert o["_status"] == 200 and o["state"] == "missing" and "does not exist yet" in o["message"]
    assert not (tmp_path / "cache").exists()  # the panel creates nothing
    bad = server.get(sort="rowid; DROP TABLE files")
    assert bad["_status"] == 400 and bad["state"] == "error" and "unknown sort" in bad["message"]
    answer = server.post("delete", namespace="../etc", key="00")
    assert answer["_status"] == 400 and not answer["ok"] and "invalid namespace" in answer["message"]
    server.close()  # a server stopping: the panel closes without a traceback in its log (it printed one)
    assert "Traceback" not in server.log() and "mlxcache panel" in server.log(), server.log()[-2000:]


def test_two_kernels_pins_rules_and_a_killed_kernels_leftovers(start_kernel, server, tmp_path):
    cache = tmp_path / "cache"
    a, b = start_kernel(), start_kernel()
    for k, prompts in ((a, ["Kernel A, first prompt about lighthouses " * 3, "Kernel A, second prompt about the sea " * 3]),
                       (b, ["Kernel B, its only prompt about harbours " * 3])):
        for p in prompts:
            assert k.execute(f"%%generate --max-tokens 4\n{p}")["status"] == "ok"
        assert k.execute("%cache flush")["status"] == "ok"
    assert a.execute("%checkpoint save keep_a")["status"] == "ok"

    def reported(o):
        pa, pb = proc(o, a.pid), proc(o, b.pid)
        return (o["state"] == "ok" and pa and pb and pa["report"] and pb["report"] and pa["files"] >= 2
                and pb["files"] >= 1 and pa["report"]["ram"]["entries"] >= 2)

    o = wait_for(server.get, reported, "both kernels with their reports")
    pa, pb = proc(o, a.pid), proc(o, b.pid)
    assert pa["alive"] and pb["alive"] and pa["in_catalogue"] and pa["heartbeat_age_s"] < 30
    assert [m["name"] for m in pa["report"]["models"]] == ["default"]
    assert o["ssd"]["files"] == pa["files"] + pb["files"] and o["ssd"]["bytes"] > 0
    [model] = [m for m in o["models"] if m["kind"] == "prefix"]
    assert model["names"] == ["default"] and model["files"] == o["ssd"]["files"] and model["pinned"] == 1
    rows = server.get(group=model["group"])["page"]["files"]
    by_writer = {pid: [f for f in rows if f["writer"]["pid"] == pid] for pid in (a.pid, b.pid)}
    assert len(by_writer[a.pid]) == pa["files"] and len(by_writer[b.pid]) == pb["files"]
    [kept] = [f for f in rows if f["pinned_by"] == ["keep_a"]]
    assert kept["writer"]["pid"] == a.pid and kept["names"][0]["held_by"] == a.pid
    assert any(r["pid"] == a.pid for r in kept["in_ram"]) and kept["preview"].startswith("Kernel A")
    b_file = by_writer[b.pid][0]
    assert [r["pid"] for r in b_file["in_ram"]] == [b.pid] and b_file["tokens"] > 0

    # sorted and filtered on the server
    tokens = [f["tokens"] for f in server.get(group=model["group"], sort="tokens", desc="0")["page"]["files"]]
    assert tokens == sorted(tokens)
    only_b = server.get(group=model["group"], q=str(b.pid))["page"]
    assert only_b["matching"] == pb["files"] and {f["writer"]["pid"] for f in only_b["files"]} == {b.pid}
    assert server.get(group=model["group"], pinned="pinned")["page"]["matching"] == 1

    # a live kernel's name is its own; what a live kernel holds in RAM is not deleted; a pin is a named checkpoint
    refused = server.post("unpin", name="keep_a")
    assert not refused["ok"] and f"pid {a.pid}" in refused["message"] and "%checkpoint rm keep_a" in refused["message"]
    assert "keep_a" in catalog_pins(cache)
    held = server.post("delete", namespace=b_file["namespace"], key=b_file["key"])
    assert not held["ok"] and "holds it in RAM" in held["message"] and catalog_has(cache, b_file["key"])
    pinned = server.post("pin", namespace=b_file["namespace"], key=b_file["key"], name="from_panel")
    assert pinned["ok"], pinned
    assert catalog_pins(cache)["from_panel"] == (b_file["namespace"], b_file["key"])
    assert "from_panel" in b.execute("%checkpoint list")["text"]  # every kernel sees the name
    taken = server.post("pin", namespace=b_file["namespace"], key=b_file["key"], name="from_panel")
    assert not taken["ok"] and "taken" in taken["message"]
    assert server.post("pin", namespace=b_file["namespace"], key=b_file["key"], name="../x")["_status"] == 400

    # once B lets its RAM go, its unpinned file can be deleted; a pinned one still cannot
    assert b.execute("%cache clear")["status"] == "ok"
    wait_for(server.get, lambda o: proc(o, b.pid)["report"]["ram"]["entries"] == 0, "B's RAM is empty")
    still_pinned = server.post("delete", namespace=b_file["namespace"], key=b_file["key"])
    assert not still_pinned["ok"] and "pinned by 'from_panel'" in still_pinned["message"]
    assert server.post("unpin", name="from_panel")["ok"]  # the panel's own name (no live kernel holds it)
    assert "from_panel" not in catalog_pins(cache)
    gone = server.post("delete", namespace=b_file["namespace"], key=b_file["key"])
    assert gone["ok"], gone
    assert not catalog_has(cache, b_file["key"])
    assert b_file["key"] not in {f["key"] for f in server.get(group=model["group"])["page"]["files"]}

    # kill -9 A: its files stay (a dead kernel's leftovers), written by a process that is gone
    a_pid = a.pid
    a.kill9()
    o = wait_for(server.get, lambda o: proc(o, a_pid) and not proc(o, a_pid)["alive"], "A found dead")
    dead = proc(o, a_pid)
    assert dead["files"] == pa["files"] and dead["report"] is not None  # its last report: what it held
    rows = server.get(group=model["group"])["page"]["files"]
    leftovers = [f for f in rows if f["writer"]["pid"] == a_pid]
    assert len(leftovers) == pa["files"] and not any(f["writer"]["alive"] for f in leftovers)
    assert not any(f["in_ram"] for f in leftovers)  # a dead process holds no RAM
    assert server.post("unpin", name="keep_a")["ok"]  # its owner is gone: the name may go
    assert "keep_a" not in catalog_pins(cache)
