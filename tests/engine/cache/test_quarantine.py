"""Only verified corruption is quarantined (issue 27): the confirming read of a block that
failed verification goes to the disk, not the page cache, and has three answers (good,
corrupt, unreadable); an I/O error there (a real EIO injected at the fault point
`block.confirm` in a worker process) is a miss and a retry, never corruption, so a named
checkpoint is never dropped for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fault_worker import NS, expected_digest, open_store, read_digest, tokens
from paused import ENV, WORKER

from mlxcache_kernel.engine.cache.ssd import blocks
from mlxcache_kernel.engine.cache.ssd import format as fmt
from mlxcache_kernel.engine.kv.tokens import token_key


def c_block(root: Path) -> Path:
    s = open_store(root)
    try:
        s.catalog.set_pin("c-named", NS, token_key(tokens("C")))
        return blocks.block_path(s.blocks_root, fmt.read_header(s.index.entries[(NS, token_key(tokens("C")))].path)
                                 .blocks[0].name)
    finally:
        s.close()


def damage(path: Path) -> bytes:
    good = path.read_bytes()
    raw = bytearray(good)
    raw[len(raw) // 2] ^= 0x5A
    path.write_bytes(bytes(raw))
    return good


def quarantined(root: Path) -> set:
    return {p.name for p in (root / "quarantine").iterdir()} - {"evidence.old"}


def test_three_answers(tmp_path):
    data = b"some block bytes" * 1000
    path = tmp_path / "b.blk"
    path.write_bytes(data)
    import blake3

    name = blake3.blake3(data).hexdigest()
    assert blocks.intact(path, name) == blocks.GOOD
    assert blocks.intact(path, "0" * 64) == blocks.CORRUPT
    assert blocks.intact(tmp_path / "gone.blk", name) == blocks.UNREADABLE


def test_a_block_that_verifies_on_its_confirming_read_stays(root):
    """A read saw a bad hash that the disk does not hold (a fault on the way): nothing moves,
    nothing is dropped."""
    path = c_block(root)
    s = open_store(root)
    s.quarantine_block(path.stem, "BLAKE3 mismatch (a bad read)")
    assert path.exists() and not quarantined(root)
    e = s.find(tuple(tokens("C")) + (-1,), NS)
    assert len(e) == len(tokens("C")) and read_digest(s, e.path) == expected_digest("C")
    s.close()


def test_eio_on_the_confirming_read_is_a_miss_never_corruption(root):
    """The first read of a named checkpoint's block fails its hash and the confirming read gets
    EIO (a real OSError in the worker): a miss; the block stays, the name keeps its checkpoint.
    Once the disk reads right again, it restores identically; a corruption the disk really
    holds is then quarantined (and only then is the named checkpoint dropped)."""
    path = c_block(root)
    good = damage(path)
    log = root.parent / "log"
    r = subprocess.run([sys.executable, WORKER, str(root), "quarantine", str(log)], capture_output=True, text=True,
                       timeout=120, env={**ENV, "MLXCACHE_FAULT": "block.confirm:eio"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x) for x in log.read_text().splitlines()] == [{"ack": "quarantine"}]  # a miss
    assert path.exists() and not quarantined(root), "an I/O error was taken for corruption"
    s = open_store(root)
    assert s.is_pinned(NS, tokens("C")) and s.contains(tokens("C"), NS), "the named checkpoint was dropped"
    path.write_bytes(good)  # the disk reads right again
    assert read_digest(s, s.index.entries[(NS, token_key(tokens("C")))].path) == expected_digest("C")
    s.gc()
    assert s.contains(tokens("C"), NS)
    s.close()
    damage(path)  # now the disk really holds other bytes: verified, quarantined
    log.unlink()
    r = subprocess.run([sys.executable, WORKER, str(root), "quarantine", str(log)], capture_output=True, text=True,
                       timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not path.exists() and [q for q in quarantined(root) if q.startswith(f"block.{path.stem}.")]
    s = open_store(root)
    assert not s.contains(tokens("C"), NS)
    s.close()
