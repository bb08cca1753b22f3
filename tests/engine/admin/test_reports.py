"""Process reports (engine/admin/reports.py): what a kernel holds, written when it changes; a dead
process's report removed by the next engine that starts."""

from __future__ import annotations

import json
import os
import time

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.admin.reports import ProcessReport, read_reports, report_dir


def test_a_report_follows_ram_and_dead_ones_go(tiny_model_dir, tmp_path):
    rdir = report_dir(tmp_path)
    rdir.mkdir(parents=True, mode=0o700)
    old, young = rdir / "0123456789abcdef.json", rdir / "fedcba9876543210.json"
    for path in (old, young):
        path.write_text(json.dumps({"owner": path.stem, "pid": 2 ** 22 + 1, "entries": []}))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    clock = [0.0]
    with Engine(cache_dir=tmp_path) as eng:
        report = ProcessReport(eng, clock=lambda: clock[0])
        assert report.maybe_write()
        assert not old.exists() and young.exists()  # a long-dead process's report goes; a young one stays
        mine = read_reports(tmp_path)[report.owner]
        assert mine["pid"] == os.getpid() and mine["entries"] == [] and mine["ram"]["entries"] == 0
        eng.load_model(str(tiny_model_dir))
        eng.generate("a prompt for the report " * 4, max_tokens=3)
        assert not report.maybe_write()  # at most once a second
        clock[0] += 1.5
        assert report.maybe_write()
        mine = read_reports(tmp_path)[report.owner]
        [entry] = mine["entries"]
        assert entry["kind"] == "prefix" and entry["preview"].startswith("a prompt for the report")
        assert [m["name"] for m in mine["models"]] == ["default"]
        clock[0] += 1.5
        assert not report.maybe_write()  # nothing changed: not written again
        assert (os.stat(report.path).st_mode & 0o777) == 0o600
        report.remove()
        assert report.owner not in read_reports(tmp_path)
