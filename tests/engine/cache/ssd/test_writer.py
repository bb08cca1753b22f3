"""The background writer: completions, failures, yielding."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
from mlxcache_kernel.engine.cache.ssd.restore import restore
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
from mlxcache_kernel.engine.cache.ssd.writer import CheckpointWriter, WriteJob
from repo_paths import SUPPORT

IDENTITY = {"artifact": "a" * 64, "config": "c1", "tokenizer": "t1", "kv_scheme": "fp"}


def make_checkpoint(tokens, heads=2, head_dim=8, layers=2, seed=0):
    mx.random.seed(seed)
    caches = []
    for _ in range(layers):
        c = KVCache()
        shape = (1, heads, len(tokens), head_dim)
        c.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        caches.append(c)
    return Checkpoint.capture(tokens, caches)


class HT:  # a HostTensor over a plain numpy array (weakref-able for the release test)
    def __init__(self, name, a):
        self.name, self.dtype, self.shape, self.array = name, str(a.dtype), a.shape, a

    @property
    def nbytes(self):
        return self.array.nbytes


def started(w: CheckpointWriter) -> None:
    """Wait until the writer thread has taken a job (however busy the machine)."""
    deadline = time.monotonic() + 60
    while w.in_progress is None:
        assert time.monotonic() < deadline, "the writer never took the job"
        time.sleep(0.01)


def plain_job(tokens, nbytes_per_tensor=1 << 20, key=None):
    n = len(tokens)
    d = nbytes_per_tensor // (4 * n)
    hts = [HT(f"layers.0.{j}", np.random.rand(1, 1, n, d).astype(np.float32)) for j in range(2)]
    layout = [{"kind": "KVCache", "meta": {"offset": n}, "arrays": 2}]
    return WriteJob("ns", IDENTITY, tuple(tokens), layout, 0, hts, trimmable=True, key=key)


def test_writes_complete_and_appear_in_index(tmp_path):
    store = CheckpointStore(tmp_path)
    store.register_namespace("ns", IDENTITY)
    w = CheckpointWriter(store)
    cps = [make_checkpoint(list(range(1, 11)) + [100 + i] * 5, seed=i) for i in range(3)]
    for i, cp in enumerate(cps):
        w.submit(WriteJob.from_checkpoint(cp, "ns", IDENTITY, key=i))
    assert w.wait(30)
    assert w.pending() == (0, 0) and w.in_progress is None
    done = w.poll()
    assert [c.key for c in done] == [0, 1, 2] and all(c.ok for c in done)
    assert all(c.path.exists() and c.bytes > c.path.stat().st_size and c.tokens == 15 for c in done)
    assert w.poll() == []
    hit = store.find(list(cps[1].tokens) + [7], "ns")
    assert hit.match_len == 15 and hit.path == done[1].path
    restored = restore(store, hit)
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(restored.arrays(), cps[1].arrays()))
    w.close()


def test_views_released_on_owner_thread_at_poll(tmp_path):
    w = CheckpointWriter(CheckpointStore(tmp_path))
    job = plain_job(range(1, 33))
    released = []
    for h in job.host_tensors:
        weakref.finalize(h.array, lambda: released.append(threading.get_ident()))
    w.submit(job)
    del job, h
    assert w.wait(30)
    time.sleep(0.05)
    assert released == []  # the finished job waits for the owner
    [c] = w.poll()
    assert c.ok and released == [threading.get_ident()] * 2
    w.close()


def test_failed_write_then_recovery(tmp_path):
    # Real failure: the namespace directory path is a regular file (stops root too).
    store = CheckpointStore(tmp_path)
    (tmp_path / "ns").write_bytes(b"not a directory")
    w = CheckpointWriter(store)
    w.submit(plain_job(range(1, 17), key="a"))
    assert w.wait(30)
    [c] = w.poll()
    assert not c.ok and isinstance(c.error, OSError) and c.path is None and c.key == "a"
    assert w._thread.is_alive()
    os.unlink(tmp_path / "ns")
    w.submit(plain_job(range(1, 17), key="b"))
    assert w.wait(30)
    [c] = w.poll()
    assert c.ok and store.stats()["files"] == 1
    w.close()


def test_failed_mid_write_removes_temp_file(tmp_path):
    # Real failure mid-file: RLIMIT_FSIZE makes write() fail with EFBIG after
    # the temp file exists (in a child, so pytest's own files are unaffected).
    script = f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(SUPPORT)!r}]\n"
    script += textwrap.dedent(f"""
        import json, os, resource, signal
        from test_writer import plain_job, CheckpointStore, CheckpointWriter
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = CheckpointStore({str(tmp_path)!r})
        w = CheckpointWriter(store)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        w.submit(plain_job(range(1, 65), nbytes_per_tensor=2 << 20))
        w.wait()
        [bad] = w.poll()
        left = os.listdir({str(tmp_path / "ns")!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        w.submit(plain_job(range(1, 65), nbytes_per_tensor=2 << 20))
        w.wait()
        [good] = w.poll()
        print(json.dumps({{"bad_ok": bad.ok, "errno": getattr(bad.error, "errno", None), "left": left,
                          "good_ok": good.ok, "files": store.stats()["files"]}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == {"bad_ok": False, "errno": 27, "left": [], "good_ok": True, "files": 1}


def test_writer_yields_to_generation(tmp_path):
    pressure = threading.Event()
    w = CheckpointWriter(CheckpointStore(tmp_path), under_pressure=pressure.is_set)
    with w.generating():
        w.submit(plain_job(range(1, 65), nbytes_per_tensor=8 << 20))
        started(w)
        time.sleep(0.4)
        assert w.in_progress == (0, 16 << 20)  # paused before its first chunk, and stays there
        assert w.pending() == (1, 16 << 20) and not w.wait(0.1)
        urgent = plain_job(range(1, 9))
        urgent.urgent = True  # an in-flight checkpoint: ahead of the rest, and no yielding behind it
        w.submit(urgent)
        assert w.pending()[0] == 2  # queued behind the paused job (one writer thread)
    assert w.wait(30) and w.pending() == (0, 0)
    assert [c.ok for c in w.poll()] == [True, True]
    with w.generating():  # memory pressure: writes go ahead during a generation
        pressure.set()
        w.submit(plain_job(range(1, 33), nbytes_per_tensor=8 << 20))
        assert w.wait(30)
    assert [c.ok for c in w.poll()] == [True]
    w.close()


def test_close_stops_thread(tmp_path):
    w = CheckpointWriter(CheckpointStore(tmp_path))
    w.submit(plain_job(range(1, 9)))
    w.close()
    assert not w._thread.is_alive() and [c.ok for c in w.poll()] == [True]


def test_abort_gives_up_a_write_in_progress_at_its_next_pause(tmp_path):
    from mlxcache_kernel.engine.cache.ssd.writer import WriteCancelled

    store = CheckpointStore(tmp_path)
    store.register_namespace("ns", IDENTITY)
    w = CheckpointWriter(store)
    with w.generating():  # the job starts and pauses at its first pause point
        w.submit(plain_job(range(1, 65), nbytes_per_tensor=8 << 20, key="k"))
        started(w)
        assert w.in_progress == (0, 16 << 20)
        assert w.abort("k", 60.0)  # wakes within the pause's 0.5 s nap, then stops (60: a bound, not a wait)
    [done] = w.poll()
    assert not done.ok and isinstance(done.error, WriteCancelled)
    assert store.stats()["files"] == 0 and not store.catalog.files()  # nothing committed
    assert w.abort("nothing", 0.1)  # nothing being written under that key: nothing to wait for
    w.submit(plain_job(range(1, 65), nbytes_per_tensor=8 << 20, key="k"))  # the same write again: fine
    assert w.wait(30) and [c.ok for c in w.poll()] == [True] and store.stats()["files"] == 1
    w.close()
