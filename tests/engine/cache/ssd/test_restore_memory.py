"""Restores allocate once per tensor (plain KV with room to grow, which the borrower taking the
entry over appends into in place) or per tensor shape, never zero or copy what they read, and
leave a process that exits at once exiting cleanly (engine/cache/ssd/restore.py)."""

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
from mlxcache_kernel.engine.cache.ssd.restore import empty_buffer, restore
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
from mlxcache_kernel.engine.cache.ssd.writer import WriteJob
from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
from mlxcache_kernel.engine.kv.layers import COMPACT_RATIO, growth_room

NS, IDENTITY = "ns", {"artifact": "restore-memory"}


def stored(root: Path, n: int = 230, layers: int = 6) -> tuple[CheckpointStore, Checkpoint]:
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


def _address(a) -> int:
    return np.asarray(a).__array_interface__["data"][0]


def test_a_restore_holds_the_state_once_with_room_to_grow(tmp_path):
    store, cp = stored(tmp_path / "c")
    [entry] = store.entries()
    mx.eval(mx.zeros((4,)))
    before = mx.get_active_memory()
    restored = restore(store, entry)
    # each plain KV tensor in a buffer of its own with mlx-lm's step of room: nothing copied on the way
    room = growth_room(len(cp))
    assert 0 < room and (len(cp) + room) % 256 == 0
    held = cp.kv_bytes * (len(cp) + room) // len(cp)
    assert restored.nbytes == held <= COMPACT_RATIO * cp.kv_bytes
    assert mx.get_active_memory() - before <= held + 64 * 1024
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(restored.arrays(), cp.arrays()))
    assert all(s.room == room for l in restored.layers for s in l.segments)


def test_a_borrower_taking_a_restored_entry_over_appends_in_place(tmp_path):
    """A hit after a restart: the restored buffers become the borrower's (the entry leaves RAM), and its
    appends land in their room, with mlx-lm's KVCache's numbers."""
    store, cp = stored(tmp_path / "c")
    [entry] = store.entries()
    restored = restore(store, entry)
    where = [[_address(p) for p in s.parents] for l in restored.layers for s in l.segments]
    n = len(cp) - 5  # a rerun: its prompt ends before the stored answer does
    caches = restored.hand_over(n, in_place=True)
    del restored
    for c, layer in zip(caches, cp.layers):
        k, v = mx.random.normal((1, 2, 9, 16)), mx.random.normal((1, 2, 9, 8))
        ref = KVCache()
        ref.update_and_fetch(*(a[..., :n, :] for a in layer.arrays))
        for got, want in zip(c.update_and_fetch(k, v), ref.update_and_fetch(k, v)):
            assert np.array_equal(np.array(got), np.array(want))
    assert [[_address(b) for b in c.buffers] for c in caches] == where


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
