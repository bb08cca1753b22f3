"""Widget state driven by real engine events (tiny random model), thread
safety of the dashboard, progress and the KV inspector."""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import struct
import threading
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import traitlets

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.widgets import GenerationProgress, KVInspector, ResidencyDashboard, TextProgress
from mlxcache_kernel.widgets import _png
from mlxcache_kernel.widgets.dashboard_render import render_entries, render_log
from mlxcache_kernel.widgets.dashboard_state import counters_from_stats
from mlxcache_kernel.widgets.inspector import norms_per_head, pick_tensors
from mlxcache_kernel.widgets.progress import ProgressTracker
from repo_paths import SUPPORT

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
KERNEL_SCRIPT = SUPPORT / "dashboard_in_kernel.py"


@pytest.fixture
def engine(tmp_path, tiny_model_dir):
    eng = Engine(cache_dir=tmp_path / "cache")
    eng.load_model(str(tiny_model_dir))
    yield eng
    eng.close()


def all_widgets(root):
    out, stack = [], [root]
    while stack:
        w = stack.pop()
        out.append(w)
        stack.extend(getattr(w, "children", ()) or ())
    return out


class TraitThreadRecorder:
    """Records the thread of every trait change on a widget tree."""

    def __init__(self, root):
        self.changes: list[tuple[str, str, str]] = []
        self._widgets = all_widgets(root)
        for w in self._widgets:
            w.observe(self._record, names=traitlets.All)

    def _record(self, change):
        self.changes.append((type(change["owner"]).__name__, change["name"], threading.current_thread().name))

    def off_main(self):
        main = threading.main_thread().name
        return [c for c in self.changes if c[2] != main]


# --- dashboard: state from real engine events ---


def test_dashboard_miss_write_queued_committed_hit(engine):
    db = ResidencyDashboard(engine, throttle_s=0)
    assert db.counters["misses"] == 0 and db.counters["ram_hits"] == 0
    assert "mlxc-empty" in db.entries_html.value

    engine.generate(PROMPT, max_tokens=4)
    # the light view follows the engine's own events on the main thread (throttle 0)
    assert db.counters["misses"] == 1
    assert db.events_seen >= 3 and db.light_refreshes >= 3
    assert "data-name='misses' data-value='1'" in db.counters_html.value
    db.refresh()  # the full view (entries) at a safe point
    states = {e["write_state"] for e in db.last_entries}
    assert states & {"pending", "dirty", "committed"}
    assert db.last_stats["writes_queued"] >= 1
    assert "mlxc-entry" in db.entries_html.value

    engine.flush()
    db.refresh()
    assert db.counters["writes_committed"] >= 1
    assert db.counters["bytes_written"] > 0
    assert all(e["write_state"] == "committed" for e in db.last_entries)
    assert any(e["tier"] in ("ram+ssd", "ssd") for e in db.last_entries) or db.last_stats["ssd_files"] >= 1
    assert "of no cap" in db.ssd_label.value and "0 B of" not in db.ssd_label.value
    assert "free on disk" in db.ssd_label.value and db.ssd_bar.value < db.ssd_bar.max  # not full without a cap

    engine.generate(PROMPT + "And then?", max_tokens=4)
    db.refresh()
    assert db.counters["ram_hits"] == 1
    assert db.counters["tokens_saved"] > 0
    assert "data-name='ram_hits' data-value='1'" in db.counters_html.value
    db.close()


def test_dashboard_ssd_hit_after_restart(tmp_path, tiny_model_dir):
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(str(tiny_model_dir))
        eng.generate(PROMPT, max_tokens=4)
        eng.flush()
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng2:  # the lookup reads the file
        eng2.load_model(str(tiny_model_dir))
        db = ResidencyDashboard(eng2, throttle_s=0)
        assert db.last_stats["ssd_files"] >= 1
        assert any(e["tier"] == "ssd" for e in db.last_entries)
        eng2.generate(PROMPT + " More.", max_tokens=4)
        db.refresh()
        assert db.counters["ssd_hits"] == 1
        assert db.counters["bytes_read"] > 0
        assert db.counters["misses"] == 0
        db.close()


def test_dashboard_eviction_and_demotion_log(tmp_path, tiny_model_dir):
    eng = Engine(cache_dir=tmp_path / "c", ram_budget_bytes=150_000)
    eng.load_model(str(tiny_model_dir))
    db = ResidencyDashboard(eng, throttle_s=0)
    for i in range(4):
        eng.generate(f"{i} unrelated prompt number {i} " * 3, max_tokens=4)
        eng.flush()
    db.refresh()
    c = db.counters
    assert c["evictions"] >= 1 and c["demotions"] >= 1
    log = db.log_html.value
    assert "mlxc-log-evict" in log and "mlxc-log-demote" in log
    assert ">budget<" in log or ">oversized<" in log
    assert db.last_stats["ram_used_bytes"] <= 150_000 or db.last_stats["pending_writes"]
    eng.close()
    db.close()


def test_dashboard_failed_write(engine):
    ns = engine.models.info()["namespace"]
    nsdir = engine.cache_dir / "checkpoints" / ns
    if nsdir.exists():
        shutil.rmtree(nsdir)
    nsdir.write_text("a file where the namespace directory should be")  # root cannot bypass this
    db = ResidencyDashboard(engine, throttle_s=0)
    engine.generate(PROMPT, max_tokens=4)
    report = engine.flush()
    assert report["failed"]
    db.refresh()
    assert db.counters["failures"] >= 1 and db.last_stats["writes_failed"] >= 1
    assert any(e["write_state"] == "failed" for e in db.last_entries)
    assert "mlxc-state-failed" in db.entries_html.value
    assert "mlxc-log-write_failed" in db.log_html.value
    assert db.last_stats["failed_entries"] >= 1
    assert f"data-failed='{db.last_stats['failed_entries']}'" in db.write_label.value
    assert "mlxc-state-failed" in db.write_label.value
    nsdir.unlink()
    db.close()


def test_dashboard_close_unsubscribes(engine):
    db = ResidencyDashboard(engine, throttle_s=0)
    db.close()
    seen = db.events_seen
    engine.generate(PROMPT, max_tokens=2)
    assert db.events_seen == seen


def test_dashboard_throttles(engine):
    db = ResidencyDashboard(engine, throttle_s=60)
    n = db.refreshes
    for i in range(3):
        engine.generate(PROMPT + str(i), max_tokens=2)
    assert db.events_seen > 5
    assert db.light_refreshes <= 1 and db.refreshes == n  # nothing within a 60 s window
    db.close()


def test_events_inside_engine_calls_never_poll(engine):
    """An event on the owner thread arrives inside the engine's own code:
    the dashboard must not call admin.entries() (which polls) from there."""
    calls = []
    real = engine.admin.entries
    engine.admin.entries = lambda: (calls.append(1), real())[1]
    db = ResidencyDashboard(engine, throttle_s=0)
    n = len(calls)
    engine.generate(PROMPT, max_tokens=4)
    engine.flush()
    assert len(calls) == n and db.light_refreshes > 0
    db.refresh()
    assert len(calls) == n + 1
    db.close()


# --- thread safety ---


def test_dashboard_background_events_never_touch_widgets_off_main(tmp_path, tiny_model_dir):
    """Events from other threads (the SSD writer's, and a thread spamming the
    bus) while the main thread generates: every widget trait is set on the
    main thread, through the loop scheduler."""
    eng = Engine(cache_dir=tmp_path / "c", ssd_budget_bytes=300_000)  # SSD capacity evictions come from the writer
    eng.load_model(str(tiny_model_dir))
    loop = asyncio.new_event_loop()
    try:
        db = ResidencyDashboard(
            eng, throttle_s=0.01, schedule=loop.call_soon_threadsafe, call_later=loop.call_later
        )
        rec = TraitThreadRecorder(db)
        emitter_threads: set[str] = set()
        eng.events.subscribe(lambda e: emitter_threads.add(threading.current_thread().name))
        stop = threading.Event()

        def spam():
            i = 0
            while not stop.is_set():
                eng.events.emit("evict", ns="x", tokens=i, nbytes=1, reason="budget")
                i += 1
                time.sleep(0.001)

        t = threading.Thread(target=spam, name="spammer", daemon=True)
        t.start()

        async def main():
            for i in range(6):
                eng.generate(f"prompt {i} " * 20, max_tokens=4)
                await asyncio.sleep(0.05)  # the loop runs scheduled refreshes
            stop.set()
            eng.flush()
            await asyncio.sleep(0.2)

        before = db.refreshes
        loop.run_until_complete(main())
        t.join()
        loop.run_until_complete(asyncio.sleep(0.05))
        assert "spammer" in emitter_threads
        assert rec.changes, "the dashboard never updated"
        assert rec.off_main() == []
        assert db.refreshes > before
        # the last spam event reached the log through a scheduled refresh
        assert "mlxc-log-evict" in db.log_html.value
        db.close()
    finally:
        loop.close()
        eng.close()


def test_dashboard_refresh_from_other_thread_is_deferred(engine):
    db = ResidencyDashboard(engine, throttle_s=0, schedule=None)
    rec = TraitThreadRecorder(db)
    n = db.refreshes
    t = threading.Thread(target=db.refresh)
    t.start()
    t.join()
    assert db.refreshes == n and rec.changes == []
    assert db.state.dirty
    db.refresh()
    assert db.refreshes == n + 1
    db.close()


def test_dashboard_in_real_ipykernel(tmp_path):
    """ipykernel 7: background-thread events refresh through the kernel's IO
    loop; no trait is set off the main thread and nothing lands on stderr."""
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "MLXCACHE_TEST_CACHE": str(tmp_path / "cache"), "MLXCACHE_TEST_MODEL": str(tmp_path / "model")}
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path), env=env)
    try:
        outputs = []

        def run(src):
            reply = kc.execute_interactive(src, timeout=120, output_hook=outputs.append)
            assert reply["content"]["status"] == "ok", reply["content"]

        run(f"%run -i {KERNEL_SCRIPT}")
        time.sleep(0.5)  # the IO loop runs the scheduled refresh between cells
        run("print('R', db.refreshes - r0, 'OFF', [n for n in threads if n != threading.main_thread().name], 'ON', len(threads))")
        run("eng.generate('hello ' * 30, max_tokens=4); eng.flush(); time.sleep(0.3)")
        run("print('C', db.counters['misses'], db.counters['writes_committed'] > 0 or db.last_stats['pending_writes'])")
        text = "".join(m["content"].get("text", "") for m in outputs if m["msg_type"] == "stream")
        errs = [m["content"]["text"] for m in outputs if m["msg_type"] == "stream" and m["content"]["name"] == "stderr"]
        assert not errs, errs
        line = [ln for ln in text.splitlines() if ln.startswith("R ")][0]
        assert int(line.split()[1]) >= 1, text  # refreshed via io_loop after the background events
        assert "OFF []" in line, text
        assert "ON 0" not in line, text
        assert "C 1 True" in text, text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# --- pure renderers ---


def test_render_entries_escapes_and_formats():
    html = render_entries(
        [
            {"preview": "<script>alert(1)</script>\nnext", "tokens": 1234, "ram_bytes": 2_500_000,
             "kv_bytes": 1_000_000, "file_bytes": None, "tier": "ram+ssd",
             "write_state": "pending", "borrowers": 1, "sessions": ["chat"], "pinned": ["v1"],
             "last_used": time.time() - 5, "hits": 3},
        ]
    )
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "1,234" in html and "2.4 MiB" in html and "976.6 KiB" in html and "ram+ssd" in html
    assert ">ram<" in html and ">kv<" in html and ">file<" in html
    assert "<td class='num'>–</td>" in html  # no SSD file
    assert "mlxc-state-pending" in html and "session chat" in html and "v1" in html and "ago" in html


def test_render_log_and_counters():
    html = render_log([{"type": "demote", "time": time.time(), "tokens": 10, "nbytes": 2048, "reason": "idle"}])
    assert "mlxc-log-demote" in html and ">idle<" in html and "2.0 KiB" in html
    c = counters_from_stats({"hits": 2, "ssd_hits": 1, "writes_failed": 1, "ssd_restore_failures": 2})
    assert c["ram_hits"] == 2 and c["failures"] == 3 and c["quarantined"] == 0
    assert c["draft_proposed"] == 0 and c["draft_acceptance"] is None  # no speculative decoding yet


def test_dashboard_shows_draft_proposed_accepted_and_the_acceptance_rate(engine, tiny_model_dir):
    engine.load_model(str(tiny_model_dir), name="twin")  # the model's own weights: every proposal accepted
    db = ResidencyDashboard(engine, throttle_s=0)
    assert "data-name='draft_acceptance' data-value=''>acceptance: <b>–</b>" in db.counters_html.value
    r = engine.generate(PROMPT, model="default", draft="twin", num_draft_tokens=3, max_tokens=12)
    engine.generate(PROMPT, model="default", max_tokens=4)  # plain decoding adds nothing to them
    db.refresh()
    proposed = r.stats["draft_tokens_proposed"]
    assert proposed > 0 and db.counters["draft_proposed"] == proposed == db.counters["draft_accepted"]
    assert db.counters["draft_acceptance"] == 1.0
    assert "acceptance: <b>100%</b>" in db.counters_html.value
    assert f"draft proposed: <b>{proposed}</b>" in db.counters_html.value
    db.close()


# --- progress ---


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_tracker_rate_eta():
    clock = FakeClock()
    t = ProgressTracker(clock)
    assert t.update("prefill", 0, 1000)
    clock.t += 2
    assert not t.update("prefill", 200, 1000)
    assert t.rate == pytest.approx(100.0)
    assert t.eta == pytest.approx(8.0)
    assert "200/1,000" in t.line() and "100 tok/s" in t.line() and "ETA 8.0 s" in t.line()


def test_generation_progress_widget_throttled_and_finished():
    clock = FakeClock()
    p = GenerationProgress(throttle_s=0.5, clock=clock)
    p.update("prefill", 0, 1000)
    for i in range(1, 10):
        clock.t += 0.1
        p.update("prefill", i * 100, 1000)
    shown = p.updates_shown
    assert 2 <= shown <= 4  # first, then at most every 0.5 s
    clock.t += 0.01
    p.update("prefill", 1000, 1000)  # the last one always shows
    assert p.bar.value == p.bar.max == 1000
    assert "1,000/1,000" in p.label.value
    assert p.bar.description == "Prefill"
    p.update("restore", 0, 50)  # a new phase shows at once
    assert p.bar.description.startswith("Restoring") and p.bar.max == 50
    p.finish()
    assert p.finished and p.layout.display == "none"
    p.update("prefill", 1, 2)  # ignored after finish


def test_progress_from_real_prefill_and_restore(tmp_path, tiny_model_dir):
    long_prompt = "lorem ipsum dolor sit amet " * 40
    with Engine(cache_dir=tmp_path / "c", prefill_chunk=64) as eng:
        eng.load_model(str(tiny_model_dir))
        p = GenerationProgress(throttle_s=0)
        calls = []
        eng.generate(long_prompt, max_tokens=2, on_progress=lambda *a: (calls.append(a), p.update(*a)))
        assert calls and calls[-1][0] == "prefill" and calls[-1][1] == calls[-1][2]
        assert p.tracker.phase == "prefill" and p.bar.value == p.bar.max > 64
        p.finish()
        eng.flush()
    with Engine(cache_dir=tmp_path / "c", prefill_chunk=64, prefetch_budget_bytes=0) as eng:  # a lookup restore
        eng.load_model(str(tiny_model_dir))
        buf = io.StringIO()
        tp = TextProgress(buf, throttle_s=0)
        phases = []
        eng.generate(long_prompt + " again", max_tokens=2, on_progress=lambda *a: (phases.append(a[0]), tp.update(*a)))
        assert "restore" in phases
        tp.finish()
        out = buf.getvalue()
        assert "Restoring from SSD" in out and out.endswith("\r")


def test_long_phases_report_from_their_first_second(tmp_path, tiny_model_dir):
    """A prefill reports 0 done before its first chunk, a restore as its blocks land, a score's context
    prefill too: a display opens when the work starts, not after its first chunk (issue 50)."""
    long_prompt = "lorem ipsum dolor sit amet " * 40
    with Engine(cache_dir=tmp_path / "c", prefill_chunk=256) as eng:
        eng.load_model(str(tiny_model_dir))
        calls = []
        eng.generate(long_prompt, max_tokens=2, on_progress=lambda *a: calls.append(a))
        assert calls[0][:2] == ("prefill", 0) and calls[0][2] > 256, calls  # before the first chunk
        scored = []
        eng.score("A different context. " * 30, [" yes", " no"], on_progress=lambda *a: scored.append(a))
        assert scored[0][:2] == ("prefill", 0) and scored[-1][1] == scored[-1][2], scored
        eng.flush()
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:  # a lookup restores the file
        eng.load_model(str(tiny_model_dir))
        restores = []
        eng.generate(long_prompt + " again", max_tokens=2, on_progress=lambda *a: restores.append(a))
        done = [d for phase, d, n in restores if phase == "restore"]
        assert done[0] == 0 and any(0 < d < done[-1] for d in done) and done == sorted(done), restores


def test_the_cell_progress_opens_for_long_phases_only(monkeypatch):
    from mlxcache_kernel.magics import output

    opened = []
    monkeypatch.setattr(output.Progress, "_open", lambda self: (opened.append(1), setattr(self, "view", TextProgress(
        io.StringIO(), throttle_s=0))))
    p = output.Progress(enabled=True)
    p("prefill", 0, 40)  # a short prompt: over before a bar would help
    p("prefill", 40, 40)
    assert not opened
    p("prefill", 0, 1600)  # a long one: at once, with nothing done yet
    assert opened and p.view.tracker.total == 1600
    p("prefill", 1, 1)  # a batch row's last token: over on arrival, the bar keeps its phase
    assert p.view.tracker.total == 1600


# --- PNG and heatmaps ---


def decode_png(data: bytes) -> np.ndarray:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    w = h = ct = None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF
        if tag == b"IHDR":
            w, h, depth, ct = struct.unpack(">IIBB", body[:10])
        elif tag == b"IDAT":
            idat += body
        pos += 12 + n
    ch = 3 if ct == 2 else 1
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + w * ch)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(h, w, ch)


def test_png_roundtrip_and_heatmap():
    rgb = np.random.default_rng(0).integers(0, 255, (7, 5, 3), dtype=np.uint8)
    assert (decode_png(_png.encode_png(rgb)) == rgb).all()
    m = np.arange(12, dtype=float).reshape(3, 4)
    png, meta = _png.heatmap_png(m, cell_h=2, min_width=4, max_width=100)
    img = decode_png(png)
    assert img.shape == (6, 4, 3) and meta["vmin"] == 0 and meta["vmax"] == 11
    assert (img[0, 0] == _png.colormap(np.array(0.0))).all() and (img[-1, -1] == _png.colormap(np.array(1.0))).all()
    wide, meta = _png.heatmap_png(np.ones((2, 5000)), max_width=500)
    assert meta["col_bin"] == 10 and decode_png(wide).shape[1] == 500


def test_norms_and_pick_tensors():
    k = np.ones((1, 2, 5, 4), np.float32)
    assert norms_per_head(k).shape == (2, 5) and np.allclose(norms_per_head(k), 2.0)
    arrays = {"layer1.values": k, "layer1.keys": k, "layer0.keys": k, "meta": np.zeros(3),
              "layer1.keys_scales": k, "layer1.packed": k.astype(np.uint32)}
    assert [n for n, _ in pick_tensors(arrays, 1)] == ["layer1.keys", "layer1.values"]
    q = {"layer3.keys": k.astype(np.uint32), "layer3.keys_scales": k, "layer3.values_scales": k}
    assert [n for n, _ in pick_tensors(q, 3)] == ["layer3.keys_scales", "layer3.values_scales"]


# --- KV inspector ---


class StubKVEngine:
    """eng.kv.info/export as documented, for the widget alone."""

    def __init__(self):
        self.last_result = object()
        self.calls = []
        self.sessions = SimpleNamespace(list=lambda: [])
        self.checkpoints = SimpleNamespace(list=lambda: [])
        self.kv = SimpleNamespace(info=self.kv_info, export=self.kv_export)

    def kv_info(self, *, session=None, checkpoint=None, last=False, layer=None):
        return [
            {"layer": i, "kind": "KVCache", "array": name, "shape": (1, 2, 9, 8), "dtype": "float32", "bytes": 576,
             "offset": 9, "blake3": "abcdef0123456789", "mean": 0.0, "std": 1.0}
            for i in range(3) for name in ("keys", "values")
        ]

    def kv_export(self, *, session=None, checkpoint=None, last=False, layer=None):
        self.calls.append(layer)
        rng = np.random.default_rng(layer)
        return {f"layer{layer}.values": rng.normal(size=(1, 2, 9, 8)).astype(np.float32),
                f"layer{layer}.keys": rng.normal(size=(1, 2, 9, 8)).astype(np.float32)}


def test_inspector_with_stub_engine():
    eng = StubKVEngine()
    ins = KVInspector(eng)
    assert ins.source.value == "last generation"
    assert list(ins.layer.options) == [("0", 0), ("1", 1), ("2", 2)]
    assert list(ins.heatmaps) == ["layer0.keys", "layer0.values"]
    ins.layer.value = 2  # as the user would: the observer redraws
    assert eng.calls[-1] == 2 and list(ins.heatmaps) == ["layer2.keys", "layer2.values"]
    img = decode_png(ins.heatmaps["layer2.keys"])
    assert img.shape[0] > 2 and img.shape[1] >= 9
    assert "3 layers, 3.4 KiB" in ins.info_html.value and "layer 2: 1.1 KiB" in ins.info_html.value
    assert any(isinstance(w, __import__("ipywidgets").Image) for w in ins.images.children)
    ins.close()


def test_inspector_real_engine(engine):
    ins = KVInspector(engine)
    assert "generate something first" in ins.message.value
    engine.generate(PROMPT, max_tokens=4, session="chat")
    ins.refresh_sources()
    labels = [v for _, v in ins.source.options]
    assert "last generation" in labels and "session: chat" in labels
    ins.select("session: chat", layer=1)
    assert ins.heatmaps, ins.message.value
    assert ins.layer.value == 1
    assert [v for _, v in ins.layer.options] == [0, 1]  # the tiny model has 2 layers
    assert list(ins.heatmaps) == ["layer1.keys", "layer1.values"]
    assert "2 layers" in ins.info_html.value
    ins.select("last generation", layer=0)
    assert list(ins.heatmaps) == ["layer0.keys", "layer0.values"] and not ins.message.value
    ins.close()


class StubStatsEngine:
    """Only what the dashboard reads: stats(), admin.entries(), events."""

    def __init__(self, **stats):
        from mlxcache_kernel.engine.events import EventBus

        self.events = EventBus()
        self.s = {"ram_used_bytes": 0, "ram_budget_bytes": 1000, "ram_entries": 0, "ssd_enabled": True,
                  "ssd_bytes": 0, "ssd_files": 0, "pending_writes": 0, "pending_write_bytes": 0, **stats}
        self.admin = SimpleNamespace(entries=lambda: [])

    def stats(self):
        return dict(self.s)


def test_dashboard_pending_write_progress_and_poll_timer():
    eng = StubStatsEngine(pending_writes=2, pending_write_bytes=3_000_000,
                          write_in_progress_bytes=250_000, write_in_progress_total=1_000_000)
    timers = []
    db = ResidencyDashboard(eng, throttle_s=0, schedule=lambda f: None, call_later=lambda d, f: timers.append((d, f)))
    assert db.write_bar.max == 1_000_000 and db.write_bar.value == 250_000
    assert "2 pending (2.9 MiB)" in db.write_label.value and "writing 244.1 KiB of 976.6 KiB" in db.write_label.value
    assert len(timers) == 1  # writes pending: the view polls (on the loop) until they are done
    eng.s.update(pending_writes=0, pending_write_bytes=0, write_in_progress_total=0)
    timers.pop()[1]()
    assert "0 pending" in db.write_label.value and db.write_bar.value == 0
    assert timers == []
    db.close()


def test_dashboard_ram_over_budget_and_ssd_off():
    eng = StubStatsEngine(ram_used_bytes=1500, ram_entries=1, ssd_enabled=False)
    db = ResidencyDashboard(eng, throttle_s=0)
    assert db.ram_bar.bar_style == "danger" and db.ram_bar.value == db.ram_bar.max == 1000
    assert "1.5 KiB of 1000 B" in db.ram_label.value and "1 entry" in db.ram_label.value
    assert "SSD tier off" in db.ssd_label.value
    db.close()


def test_ram_bar_under_the_adaptive_budget_is_drawn_against_what_the_guard_allows():
    """No budget: the working set against the high-water mark, calm until near it (not a full red bar)."""
    mib = 1 << 20
    eng = StubStatsEngine(ram_used_bytes=int(20.7 * mib), ram_budget_bytes=None, ram_entries=3,
                          memory_working_bytes=300 * mib, memory_high_water_bytes=1000 * mib)
    db = ResidencyDashboard(eng, throttle_s=0)
    assert db.ram_bar.bar_style == "info" and db.ram_bar.max == 1000 * mib and db.ram_bar.value == 300 * mib
    label = db.ram_label.value
    assert "20.7 MiB cached" in label and "kernel 300.0 MiB of the 1000.0 MiB the memory guard allows" in label
    assert "no budget" not in label and "3 entries" in label
    eng.s.update(memory_working_bytes=950 * mib)  # near the water mark: a warning
    db.refresh()
    assert db.ram_bar.bar_style == "warning"
    eng.s.update(memory_working_bytes=1200 * mib)  # past it: the guard reclaims
    db.refresh()
    assert db.ram_bar.bar_style == "danger" and db.ram_bar.value == db.ram_bar.max
    eng.s.update(memory_working_bytes=None, memory_high_water_bytes=None)  # before the first reading
    db.refresh()
    assert db.ram_bar.bar_style == "info" and "memory not measured yet" in db.ram_label.value
    db.close()


def test_labels_show_shared_directories_failing_writes_and_ram_only():
    from mlxcache_kernel.widgets.dashboard_render import ssd_label, write_label

    shared = ssd_label({"ssd_enabled": True, "ssd_bytes": 3 << 20, "ssd_files": 4, "ssd_processes": 3,
                        "ssd_processes_pending_writes": 5})
    assert "shared by 3 processes (5 writes pending)" in shared and "data-processes='3'" in shared
    assert "shared by" not in ssd_label({"ssd_enabled": True, "ssd_processes": 1})
    dedup = ssd_label({"ssd_enabled": True, "ssd_bytes": 3 << 20, "ssd_files": 2, "ssd_blocks": 7,
                       "ssd_bytes_deduplicated": 5 << 20})
    assert "3.0 MB unique" in dedup or "3 MB unique" in dedup or "unique of" in dedup
    assert "7 shared blocks" in dedup and "not rewritten (deduplicated)" in dedup and "data-deduplicated='5242880'" in dedup
    from mlxcache_kernel.widgets.dashboard_render import remote_label

    assert remote_label({"remote_url": None}) == ""
    remote = remote_label({"remote_url": "redis://***@10.0.0.5:6379", "remote_state": "open until 12:00:05",
                           "remote_last_error": "connection refused", "remote_hits": 3, "remote_tokens": 960})
    assert "remote redis://***@10.0.0.5:6379" in remote and "open until 12:00:05" in remote
    assert "3 hits (960 tokens)" in remote and "last error: connection refused" in remote
    assert "UNAUTHENTICATED" not in remote and "rejected" not in remote
    flagged = remote_label({"remote_url": "redis://10.0.0.5:6379", "remote_auth": "UNAUTHENTICATED (remote_insecure)",
                            "remote_wrong_size": 2, "remote_mac_rejected": 1, "remote_deadline_missed": 3})
    assert "UNAUTHENTICATED" in flagged and "data-auth='open'" in flagged
    assert "rejected: 1 forged or foreign, 2 wrong size, 3 past their deadline" in flagged
    off = ssd_label({"ssd_enabled": False, "ssd_disabled_reason": "cache directory /x is not usable (<denied>)"})
    assert "SSD tier off: cache directory /x is not usable (&lt;denied&gt;)" in off
    failing = write_label({"pending_writes": 0, "write_error": "[Errno 28] No space left on device"})
    assert "writes failing: [Errno 28] No space left on device" in failing
    assert "failing" not in write_label({"pending_writes": 0, "write_error": None})


def test_history_plot_and_memory_marks():
    from mlxcache_kernel.widgets.history import History, memory_label

    h = History(size=5)
    assert "waiting" in h.render()
    for i in range(8):
        h.add({"ram_used_bytes": i << 20, "ssd_bytes": (i // 2) << 20, "hits": i, "misses": i // 3}, now=float(i))
    svg = h.render()
    assert "data-samples='5'" in svg and svg.count("<polyline") == 2 and "hits</title>" in svg
    h.add({"ram_used_bytes": 7 << 20, "ssd_bytes": 3 << 20, "hits": 7, "misses": 2})
    assert "data-samples='5'" in h.render()  # an unchanged reading adds nothing
    label = memory_label({"memory_working_bytes": 9 << 30, "memory_high_water_bytes": 8 << 30,
                          "memory_low_water_bytes": 7 << 30, "pressure_reclaims": 2})
    assert "reclaim past 8.0 GiB down to 7.0 GiB" in label and "over the high-water mark" in label
    assert "not measured" in memory_label({})
