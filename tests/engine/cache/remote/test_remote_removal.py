"""Removal that stays removed (issue 30), on real Redis and Valkey servers: remove() leaves a signed
tombstone at every prefix key, so writing the captured records back (a replay by anyone who can
write to the server) is a miss, while what is published after the removal is read again."""

from __future__ import annotations

import numpy as np
from remote_fixtures import PW, SECRET, kind, server  # noqa: F401  (fixtures)

from mlxcache_kernel.engine.cache.remote import RemoteTier, Value
from mlxcache_kernel.engine.cache.remote.keys import block_name
from mlxcache_kernel.engine.cache.remote.writers import SigningKey

BS = 32
ALICE, BOB = SigningKey.generate(), SigningKey.generate()
LISTED = f"alice={ALICE.public_text()},bob={BOB.public_text()}"


def values_of(n: int, seed: int) -> list[Value]:
    rng = np.random.default_rng(seed)
    out = [rng.integers(0, 256, 4096, dtype=np.uint8).tobytes() for _ in range(n)]
    return [Value(block_name(v), len(v), lambda v=v: v) for v in out]


def tier(server, key=ALICE, writers=LISTED) -> RemoteTier:
    return RemoteTier(server.url(password=PW), secret=SECRET, signing_key=key, writers=writers)


def records(server) -> dict:
    """Every record value on the server (chain and exact), by key: what a replayer captures."""
    c = server.client()
    return {k: c.get(k) for k in c.scan_iter(count=1000) if b":rec:" in k or b":ext:" in k}


def test_records_written_back_after_a_remove_are_misses(server):
    toks = [int(t) for t in np.random.default_rng(1).integers(0, 50_000, 4 * BS + 3)]
    blocks = values_of(4, seed=1)
    with tier(server) as alice, tier(server, key=None) as reader:
        assert alice.publish("ns", toks, BS, blocks, {"tensors": [], "layers": []}) and alice.wait(10) == []
        assert alice.publish_exact("ns", toks, BS, blocks, lambda: b"manifest bytes") and alice.wait(10) == []
        assert len(reader.probe("ns", toks, BS).records) == 4 and reader.probe("ns", toks, BS, exact=True).exact
        captured = records(server)
        assert len(captured) == 5  # four chain records, one exact record
        assert alice.remove("ns", toks, BS) == 5 and records(server) == {}
        c = server.client()
        for k, v in captured.items():
            c.set(k, v)  # the replay: every captured value written back, byte for byte
        found = reader.probe("ns", toks, BS, exact=True)
        assert found.records == [] and found.exact is None  # still removed
        assert reader.stats()["tombstoned"] == 5  # the exact record, and every record the run could end on
        assert alice.publish("ns", toks, BS, blocks, {"tensors": [], "layers": []}) and alice.wait(10) == []
        assert len(reader.probe("ns", toks, BS).records) == 4  # published after the removal: read again
        with tier(server, key=BOB) as bob:  # any listed member's removal holds for every reader
            bob.remove("ns", toks[:2 * BS], BS)
        for k, v in captured.items():
            c.set(k, v)
        assert reader.probe("ns", toks, BS).records == []


def test_a_tombstone_from_outside_the_allow_list_removes_nothing_it_did_not_unlink(server):
    toks = [int(t) for t in np.random.default_rng(2).integers(0, 50_000, 3 * BS)]
    blocks = values_of(3, seed=2)
    with tier(server) as alice, tier(server, key=None) as reader:
        assert alice.publish("ns", toks, BS, blocks, {"tensors": [], "layers": []}) and alice.wait(10) == []
        captured = records(server)
        with tier(server, key=SigningKey.generate(), writers=None) as outsider:  # holds the secret, not listed
            outsider.remove("ns", toks, BS)
        for k, v in captured.items():
            server.client().set(k, v)
        assert len(reader.probe("ns", toks, BS).records) == 3  # its tombstones are not read
        assert reader.stats()["unknown_writer"] >= 3
