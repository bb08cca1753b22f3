"""One SSD-tier operation in a process of its own, for the crash tests
(tests/engine/cache/test_faults.py): the storage layer only (no MLX), on checkpoints made
of deterministic numpy KV.

    python fault_worker.py ROOT SCENARIO LOG

SCENARIO: write | replace | gc | clear | quarantine | restore | clear-rewrite | temps | deferred (see OPS), or
read:NAME (logs the digest of what it read). With
MLXCACHE_FAULT set the process dies, or an error is raised, at that point
(engine/cache/faults.py); an operation that fails is tried once more (the
fault fires once), as the engine's writer retries. LOG gets one JSON line per
operation that returned ("ack": what the caller would have been told), and
is fsynced, so what it holds was acknowledged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import blake3
import numpy as np

from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.cache.ssd.persist import persist
from mlxcache_kernel.engine.cache.ssd.tensor_read import read_tensors
from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore, CheckpointUnavailable
from mlxcache_kernel.engine.cache.ssd.writer import WriteJob

NS = "ns"
IDENTITY = {"artifact": "fault-harness"}
_rng = np.random.default_rng(11)
SEQS = [tuple(int(t) for t in _rng.integers(3, 5000, 256)) for _ in range(2)]
_KV = _rng.standard_normal((2, 4, 1, 2, 256, 8)).astype(np.float32)  # seq, (layer, K/V), batch, heads, tokens, dim
# The checkpoints of the prepared directory, and those the scenarios write:
# (sequence, start, end, trimmable, salt); A is named, A and B share blocks.
CHECKPOINTS = {
    "A": (0, 0, 96, True, 0), "B": (0, 0, 160, True, 0), "C": (1, 0, 64, True, 0), "D": (1, 100, 140, False, 0),
    "E": (0, 0, 200, True, 0), "C2": (1, 0, 64, True, 1),
}


class HostTensor:  # what the writer gets from a Checkpoint: a numpy view and its description
    def __init__(self, name: str, array: np.ndarray):
        self.name, self.dtype, self.shape, self.array, self.span = name, "float32", array.shape, array, True

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


def tokens(name: str) -> tuple:
    seq, a, b, _, _ = CHECKPOINTS[name]
    return SEQS[seq][a:b]


def job(name: str) -> WriteJob:
    seq, a, b, trimmable, salt = CHECKPOINTS[name]
    arrays = [np.ascontiguousarray(_KV[seq, i, ..., a:b, :] + salt) for i in range(4)]
    hts = [HostTensor(f"layers.{i // 2}.{i % 2}", x) for i, x in enumerate(arrays)]
    layout = [{"kind": "KVCache", "meta": {"offset": b - a}, "arrays": 2}] * 2
    return WriteJob(NS, IDENTITY, tokens(name), layout, 0, hts, trimmable)


def digest_of(arrays: dict) -> str:
    h = blake3.blake3()
    for name in sorted(arrays):
        h.update(np.ascontiguousarray(arrays[name]).view(np.uint8).reshape(-1))
    return h.hexdigest()


def expected_digest(name: str) -> str:
    return digest_of({h.name: h.array for h in job(name).host_tensors})


def read_digest(store: CheckpointStore, path) -> str:
    """Every tensor of the file at `path`, verified (raises on any problem)."""
    h = fmt.read_header(path)
    return digest_of(read_tensors(path, h, lambda n, dt, sh: np.empty(sh, fmt.host_dtype(dt)), store.blocks_root))


def open_store(root, **kw) -> CheckpointStore:
    store = CheckpointStore(Path(root), **kw)
    store.register_namespace(NS, IDENTITY)
    return store


def assert_nothing_leaks(store: CheckpointStore) -> None:
    """After a gc: the blocks on disk are exactly those indexed files reference, each with its
    row; every manifest is indexed; no temp file, quarantined file, claim, lease or freeing
    mark is left, no process (or heartbeat) but this one; the byte totals are exact."""
    root = store.root
    entries = store.entries()
    referenced = {b.name for e in entries for b in fmt.read_header(e.path).blocks}
    on_disk = {p.stem for p in (root / "blocks").glob("*.blk")}
    assert on_disk == referenced, f"blocks leaked: {on_disk - referenced}, missing: {referenced - on_disk}"
    assert set(store.catalog.blocks()) == on_disk
    assert {str(p) for p in root.glob("*/*.ckpt")} == {str(e.path) for e in entries}, "a manifest outside the index"
    assert not list(root.rglob(".*.tmp")), "temp files left"
    kept = sorted(str(p) for p in (root / "quarantine").iterdir())  # evidence: gc keeps it until asked
    assert store.gc(quarantine=True)["quarantine_removed"] == kept and not list((root / "quarantine").iterdir())
    q = store.catalog.query
    assert [q(f"SELECT COUNT(*) FROM {t}")[0][0] for t in ("claims", "leases", "freeing")] == [0, 0, 0]
    assert [r[0] for r in q("SELECT owner FROM procs")] == [store.catalog.owner]
    assert os.listdir(root / ".heartbeats") == [store.catalog.owner], "heartbeat files of the dead left"
    totals = dict(q("SELECT k, v FROM totals"))
    assert totals["block_bytes"] == sum(p.stat().st_size for p in (root / "blocks").glob("*.blk"))
    assert totals["blocks"] == len(on_disk)
    assert totals["file_bytes"] == q("SELECT COALESCE(SUM(file_bytes), 0) FROM files")[0][0]
    assert not q("SELECT 1 FROM files f WHERE pinned != (SELECT COUNT(*) FROM pins p WHERE p.namespace = f.namespace "
                 "AND p.key = f.key)"), "a file's pin count is off"


def write(store: CheckpointStore, name: str) -> None:
    store.publish(persist(store, job(name)).info)


def read(store: CheckpointStore, name: str) -> None:
    """A verified read of checkpoint `name` (CheckpointUnavailable: a miss)."""
    entry = store.find(tuple(tokens(name)) + (-1,), NS, min_len=len(tokens(name)))
    if entry is None or len(entry) != len(tokens(name)):
        raise CheckpointUnavailable(f"{name} is not indexed")
    store.read(entry, lambda n, dt, sh: np.empty(sh, fmt.host_dtype(dt)), lambda h: None)


def read_bad(store: CheckpointStore, name: str) -> None:
    try:
        read(store, name)
    except CheckpointUnavailable:
        return  # the expected outcome: a miss
    raise AssertionError(f"{name} read although a block of it is damaged")


def read_logged(store: CheckpointStore, name: str) -> str:
    """Read `name` and return the digest of what was read."""
    entry = store.find(tuple(tokens(name)) + (-1,), NS, min_len=len(tokens(name)))
    if entry is None:
        raise CheckpointUnavailable(f"{name} is not indexed")
    pending = store.open_read(entry)
    buffers = pending.allocate(lambda n, dt, sh: np.empty(sh, fmt.host_dtype(dt)))
    pending.fill()
    pending.finish(lambda h: None)
    return digest_of(buffers)


def temps(store: CheckpointStore) -> None:
    """Temp files of a dead writer (its tag is no live process's) beside blocks and a manifest, then gc."""
    for d in (store.blocks_root, store.root / NS):
        (d / f".{'7' * 64}.blk.deadbeef0000.{len(os.listdir(d))}.tmp").write_bytes(b"half a block")
    store.gc()


def deferred(store: CheckpointStore) -> None:
    """clear, then the keeper's deferred directory fsyncs, run here (a failed one is kept for
    the next turn: run again)."""
    store.clear()
    store._fsync_unsynced()
    if store._unsynced:
        store._fsync_unsynced()
    assert not store._unsynced


OPS = {
    "write": lambda s: write(s, "E"),  # new blocks and a manifest; supersedes B
    "replace": lambda s: write(s, "C2"),  # C's tokens, other bytes: the old version's blocks go
    "gc": lambda s: s.gc(),
    "clear": lambda s: s.clear(),  # all but the named A
    "quarantine": lambda s: read_bad(s, "C"),  # a block of C was damaged beforehand: a miss
    "restore": lambda s: read(s, "B"),
    "clear-rewrite": lambda s: (s.clear(), write(s, "C")),  # the same blocks again, in the same process
    "temps": temps,
    "deferred": deferred,  # (its fsyncs are the keeper's: engine/cache/test_faults.py runs them apart)
}


def build_template(root: Path) -> None:
    """A cache directory as a crash leaves one: A (named), B (extends A), C, D (exact-only);
    an orphan block, a manifest whose block never existed, evidence in quarantine, and a
    writer killed after its blocks, before recording them."""
    import blake3

    from mlxcache_kernel.engine.cache.ssd import blocks
    from mlxcache_kernel.engine.cache.ssd.blocks import BlockRef
    from mlxcache_kernel.engine.kv.tokens import token_key

    s = open_store(root)
    write(s, "A")
    s.catalog.set_pin("named", NS, token_key(tokens("A")))
    for name in "BCD":
        write(s, name)
    data = os.urandom(1000)
    name = blake3.blake3(data).hexdigest()
    s.catalog.add_blocks({name: blocks.write(blocks.block_path(s.blocks_root, name), b"", [memoryview(data)])})
    j = job("E")
    fmt.write_checkpoint(s.prepare_path(NS, j.tokens), identity=IDENTITY, namespace=NS, tokens=j.tokens,
                         layout=j.layout, min_reusable_offset=0, host_tensors=j.host_tensors, trimmable=True,
                         blocks=[BlockRef("f" * 64, 0, 200, 200 * 256)])
    (root / "quarantine" / "evidence.old").write_bytes(b"found bad before")
    s.close()
    env = {**os.environ, "MLXCACHE_FAULT": "write.blocks_synced:kill"}
    r = subprocess.run([sys.executable, __file__, str(root), "write", os.devnull], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -9, r.stderr


def prepare(template: Path, d: Path, scenario: str) -> Path:
    """A copy of the template at d/c for `scenario` (for "quarantine", a block of C goes bad on the disk)."""
    import shutil

    from mlxcache_kernel.engine.cache.ssd import blocks

    root = d / "c"
    shutil.copytree(template, root)
    if scenario == "quarantine":
        path = blocks.block_path(root / "blocks", bad_block(root))
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x5A
        path.write_bytes(bytes(raw))
    return root


def bad_block(root: Path) -> str:
    """The block of C the quarantine scenario damages."""
    import sqlite3

    from mlxcache_kernel.engine.kv.tokens import token_key

    db = sqlite3.connect(root / "catalog.db")
    try:
        path = db.execute("SELECT path FROM files WHERE key=?", (token_key(tokens("C")),)).fetchone()[0]
    finally:
        db.close()
    return fmt.read_header(root / path).blocks[0].name


def _power_loss(root: str):
    """MLXCACHE_POWERLOSS=DIR: record what becomes durable (power_loss.py);
    MLXCACHE_POWERLOSS_MUTATE=ssd.blocks.fsync_file,...: those functions of the engine do nothing."""
    out = os.environ.get("MLXCACHE_POWERLOSS")
    if not out:
        return None
    import importlib

    from power_loss import install

    for target in filter(None, os.environ.get("MLXCACHE_POWERLOSS_MUTATE", "").split(",")):
        module, _, name = target.rpartition(".")
        module = importlib.import_module(f"mlxcache_kernel.engine.cache.{module}")
        assert callable(getattr(module, name)), target
        setattr(module, name, lambda *a, **k: None)
    return install(root, out)


def main() -> None:
    root, scenario, log = sys.argv[1], sys.argv[2], sys.argv[3]
    recorder = _power_loss(root)
    store = open_store(root)
    trace = os.environ.get("MLXCACHE_FAULT_TRACE")
    if trace:
        with open(trace, "a") as f:
            f.write("--- op\n")
    with open(log, "a") as out:
        for _ in range(2):
            try:
                if scenario.startswith("read:"):  # read a checkpoint, say what was read
                    result = {"ack": scenario, "digest": read_logged(store, scenario.removeprefix("read:"))}
                else:
                    OPS[scenario](store)
                    result = {"ack": scenario}
            except Exception as exc:
                result = {"failed": scenario, "error": f"{type(exc).__name__}: {exc}"}
            out.write(json.dumps(result) + "\n")
            out.flush()
            os.fsync(out.fileno())
            if "ack" in result:
                if recorder is not None:
                    recorder.ack()
                break
    store.close()


if __name__ == "__main__":
    main()
