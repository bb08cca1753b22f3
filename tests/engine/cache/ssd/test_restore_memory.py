"""Restores allocate once per tensor shape, never zero or copy what they read,
and leave a process that exits at once exiting cleanly (engine/cache/ssd/restore.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxcache_kernel.engine.cache.ssd import restore as restore_mod
from mlxcache_kernel.engine.cache.ssd.persist import persist
from mlxcache_kernel.engine.cache.ssd.tensor_read import _merged
from mlxcache_kernel.engine.cache.ssd.restore import empty_buffer, restore
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
from mlxcache_kernel.engine.cache.ssd.writer import WriteJob
from mlxcache_kernel.engine.kv.checkpoint import Checkpoint

NS, IDENTITY = "ns", {"artifact": "restore-memory"}


def stored(root: Path, n: int = 200, layers: int = 6) -> tuple[CheckpointStore, Checkpoint]:
    mx.random.seed(n)
    caches = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 8)))  # two shapes
        caches.append(c)
    cp = Checkpoint.capture(list(range(1, n + 1)), caches)
    store = CheckpointStore(root)
    store.register_namespace(NS, IDENTITY)
    store.publish(persist(store, WriteJob.from_checkpoint(cp, NS, IDENTITY)).info)
    return store, cp


def test_a_restore_holds_the_state_once(tmp_path):
    store, cp = stored(tmp_path / "c")
    [entry] = store.entries()
    mx.eval(mx.zeros((4,)))
    before = mx.get_active_memory()
    restored = restore(store, entry)
    # one buffer per shape, each tensor a view of it: nothing copied on the way
    assert mx.get_active_memory() - before <= cp.kv_bytes + 64 * 1024
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(restored.arrays(), cp.arrays()))
    assert restored.nbytes == cp.kv_bytes


def test_empty_buffer_is_mlx_memory_of_the_stored_type(monkeypatch):
    a = empty_buffer("bfloat16", (3, 5))
    view = np.asarray(a)
    assert a.dtype == mx.uint16 and view.shape == (3, 5) and view.flags.writeable
    view[:] = 7
    assert np.array(a).tolist() == [[7] * 5] * 3
    # an MLX that reads .npy some other way: zeroed memory instead
    monkeypatch.setattr(restore_mod.mx, "load", lambda *a, **k: (_ for _ in ()).throw(TypeError("no")))
    z = empty_buffer("float32", (2, 4))
    assert z.dtype == mx.float32 and np.array(z).tolist() == [[0.0] * 4] * 2


def test_consecutive_slices_of_one_allocation_are_read_as_one():
    group = np.asarray(empty_buffer("float32", (6, 1, 2, 4, 8)))
    views = [group[i] for i in range(6)]
    assert [v.shape for v in _merged(views)] == [(6, 1, 2, 4, 8)]
    assert [v.shape for v in _merged([views[0], views[1], views[3]])] == [(2, 1, 2, 4, 8), (1, 1, 2, 4, 8)]
    assert [v.shape for v in _merged([np.zeros((1, 2, 4, 8))] * 2)] == [(1, 1, 2, 4, 8)] * 2


def test_a_process_that_restores_and_exits_at_once_exits_cleanly(tmp_path):
    """MLX drops its reader of an allocation slot on a worker thread that needs the GIL
    (empty_buffer waits for that): exiting right after restores is clean."""
    stored(tmp_path / "c", n=64)
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from mlxcache_kernel.engine.cache.ssd.restore import empty_buffer, restore
        from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
        store = CheckpointStore(Path({str(tmp_path / "c")!r}))
        store.register_namespace({NS!r}, {IDENTITY!r})
        [e] = store.entries()
        restore(store, e)
        for _ in range(2):
            empty_buffer("float32", (1 << 24,))
    """)
    for _ in range(6):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
