"""What a curious server reader sees (issue 30), on real Redis and Valkey servers: another team on
the same server runs the same public model on a guessed prompt and so holds that prompt's KV, its
block values and their BLAKE3 names, bit for bit; none of it appears in anything the team stored.
"""

from __future__ import annotations

import blake3
import numpy as np
from remote_fixtures import PW, SECRET, kind, server  # noqa: F401  (fixtures)

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.cache.remote.keys import AEAD_OVERHEAD
from mlxcache_kernel.engine.cache.ssd import blocks

PROMPT = [int(x) for x in np.random.default_rng(11).integers(3, 259, 300)]


def _run(eng: Engine, model_dir):
    """Run PROMPT; its namespace and its KV's block values by name, as its SSD holds them."""
    eng.load_model(model_dir, name="m")
    eng.generate_tokens(PROMPT, max_tokens=4, model="m")
    assert eng.flush()["remote_failed"] == []
    ns, tokens = eng.last_key
    info = eng.cache.store.file_info(ns, tokens)
    root = eng.cache.store.blocks_root
    return ns, {b.name: blocks.block_path(root, b.name).read_bytes() for b in info.header.blocks
                if b.end - b.start == blocks.BLOCK_TOKENS}  # the full blocks: what the remote shares


def _dump(server) -> dict[bytes, bytes]:
    c = server.client()
    return {k: c.get(k) for k in c.scan_iter(count=1000) if c.type(k) == b"string"}


def test_a_guessed_prompts_kv_links_to_nothing_on_the_server(server, tiny_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "team", remote_url=server.url(password=PW), remote_secret=SECRET) as team:
        ns, stored = _run(team, tiny_model_dir)
    with Engine(cache_dir=tmp_path / "other-team") as other:  # no remote: it only computes
        other_ns, guessed = _run(other, tiny_model_dir)
    assert other_ns == ns and guessed == stored  # the attack's premise: the same KV, bit for bit
    dump = _dump(server)
    sizes = sorted(len(v) - AEAD_OVERHEAD for k, v in dump.items() if b":blk:" in k)
    assert sizes == sorted(len(v) for v in stored.values())  # every block is there, encrypted
    everything = b"\0".join(list(dump) + list(dump.values()))
    hashes = {blake3.blake3(v).hexdigest() for v in dump.values()}
    tokens = np.asarray(PROMPT, dtype="<i4").tobytes()
    for name, value in guessed.items():
        assert name.encode() not in everything and bytes.fromhex(name) not in everything  # no plain block name
        assert name not in hashes  # hashing what the server holds links nothing to a block
        for at in range(0, len(value) - 64, max(64, len(value) // 8)):
            assert value[at:at + 64] not in everything  # no piece of the KV (or its header) in clear
    for at in range(0, len(tokens) - 16, 16):
        assert tokens[at:at + 16] not in everything  # no run of four prompt token ids (int32)
    assert ns.encode() not in everything  # nor which model it was run on
