"""The remote tier against real redis-server processes (one server with ACL users, a 3-node cluster).

Pure pieces (URLs, keys, records, breaker, estimate) are tested without a
server; everything else talks to servers this module starts on loopback.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time

import blake3
import numpy as np
import pytest
import redis
from redis_servers import RedisClusterNodes, RedisServer, make_tls_files, missing

from mlxcache_kernel.engine.cache.remote import (RemoteConfigError, RemoteMiss, RemoteTier, block_name,
                                                 namespace_root, parse_remote_url, prefix_keys, redact)
from mlxcache_kernel.engine.cache.remote.breaker import Breaker
from mlxcache_kernel.engine.cache.remote.keys import KeySpace
from mlxcache_kernel.engine.cache.remote.publisher import Publisher
from mlxcache_kernel.engine.cache.remote.records import RemoteRecord, mac_key, seal, unseal

BS = 64  # tokens per block in these tests
PW = "pw-9c1e-SECRET"  # default user's password
USER, USER_PW = "carol-user-7f3", "carol-pw-4d2b-SECRET"
SECRET = b"team secret of at least 16 bytes"
ACL = (f"{USER} on >{USER_PW} ~* &* +@all",)


def blocks_of(n: int, size: int = 256 * 1024):
    values = [os.urandom(size) for _ in range(n)]
    return values, [(block_name(v), (lambda v=v: v)) for v in values]


def tokens_for(n_blocks: int, seed: int = 0, extra: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * BS + extra).tolist()


def publish(tier: RemoteTier, ns: str, tokens, blocks, layout=None) -> list[str]:
    assert tier.publish(ns, tokens, BS, blocks, layout or {"kv": "test"})
    return tier.wait(30)


def _outcome(fn, *args):
    """fn's result or the exception it raised (so tests can assert on the kind)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return e


def assert_no_secrets(*texts: str) -> None:
    for text in texts:
        for secret in (PW, USER, USER_PW):
            assert secret not in text, f"{secret!r} shown in {text[:200]!r}"


# --- servers ---

@pytest.fixture(scope="module")
def need_redis():
    why = missing()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def server(need_redis, tmp_path_factory):
    s = RedisServer(tmp_path_factory.mktemp("redis"), password=PW, users=ACL).start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(need_redis, tmp_path_factory):
    c = RedisClusterNodes(tmp_path_factory.mktemp("cluster"), password=PW, users=ACL).start()
    yield c
    c.stop()


@pytest.fixture
def own_server(need_redis, tmp_path):
    """A server this test may kill or fill."""
    made = []

    def make(**kw):
        made.append(RedisServer(tmp_path / f"s{len(made)}", password=PW, users=ACL, **kw).start())
        return made[-1]

    yield make
    for s in made:
        s.stop()


# --- URLs and redaction ---

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


# --- keys and records ---

def test_prefix_keys_chain():
    root = namespace_root("model-a", "team")
    toks = tokens_for(4)
    keys = prefix_keys(root, toks, BS)
    assert len(keys) == 4 and all(len(k) == 32 for k in keys)  # the 5 extra tokens make no key
    assert keys[0] == blake3.blake3(root + np.asarray(toks[:BS], "<i4").tobytes()).digest()
    assert keys[1] == blake3.blake3(keys[0] + np.asarray(toks[BS:2 * BS], "<i4").tobytes()).digest()
    assert prefix_keys(root, toks[: 2 * BS], BS) == keys[:2]
    assert prefix_keys(root, np.asarray(toks, np.int64), BS) == keys
    changed = list(toks)
    changed[2 * BS + 3] += 1
    assert prefix_keys(root, changed, BS)[:2] == keys[:2] and prefix_keys(root, changed, BS)[2:] != keys[2:]
    others = [namespace_root("model-b", "team"), namespace_root("model-a", "other"), namespace_root("model-a")]
    assert len({root, *others}) == 4 and all(prefix_keys(r, toks, BS)[0] != keys[0] for r in others)
    with pytest.raises(ValueError, match="int32"):
        prefix_keys(root, [2**31], 1)
    with pytest.raises(ValueError, match="block_size"):
        prefix_keys(root, toks, 0)


def test_records_are_sealed_to_their_key():
    k1, k2 = (blake3.blake3(bytes([i])).digest() for i in (1, 2))
    rec = RemoteRecord(3, 192, 256, "ab" * 32, "ns", {"layers": 2})
    key = mac_key(SECRET)
    value = seal(k1, rec, json.dumps(rec.layout), key)
    assert unseal(k1, value, key) == rec and unseal(k1, value, key).layout == {"layers": 2}
    assert unseal(k1, value, mac_key(b"another secret, 16+ bytes")) is None  # wrong team
    assert unseal(k2, value, key) is None  # replayed under another prefix
    assert unseal(k1, value[:-1], key) is None and unseal(k1, b"junk", key) is None
    assert unseal(k1, seal(k1, rec, "{}", None), key) is None  # unkeyed record, keyed reader
    with pytest.raises(ValueError, match="16 bytes"):
        mac_key(b"short")


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
    tier = RemoteTier("redis://127.0.0.1:1")  # never contacted here
    assert not tier.worth_fetching(128, 20_000, 100.0)  # short prefix: recompute
    tier.meter.round_trip(0.0005)
    tier.meter.transfer(64 << 20, 0.1)  # 640 MB/s measured
    assert tier.worth_fetching(2048, 20_000, 100.0)  # 41 MB in ~0.07 s vs 20 s of prefill
    assert not tier.worth_fetching(2048, 20_000, 1e6)  # a prefill faster than the network
    for _ in range(20):
        tier.meter.transfer(1 << 20, 1.0)  # the link became 1 MB/s
    assert not tier.worth_fetching(2048, 20_000, 100.0)
    tier.close()


def test_publisher_reports_failures_and_never_raises():
    gate = threading.Event()

    def run(job):
        gate.wait(5)
        if job == "bad":
            raise RuntimeError("boom")

    p = Publisher(run, lambda e: f"{type(e).__name__}: {e}", max_pending=2)
    assert p.submit("ok", "a") and p.submit("bad", "b")
    time.sleep(0.05)
    assert p.submit("x", "c") and not p.submit("y", "d")  # one running, two queued: full
    assert any("already queued" in f for f in p.wait(0.05))  # and the timeout says what is pending
    gate.set()
    assert p.wait(5) == ["b: RuntimeError: boom"]
    assert p.close() == [] and not p.submit("z", "e")


# --- against a server ---

def test_round_trip_with_acl_user(server):
    values, blocks = blocks_of(5)
    toks = tokens_for(5, seed=1)
    with RemoteTier(server.url(USER, USER_PW), secret=SECRET, salt="lab") as tier:
        assert publish(tier, "ns-acl", toks, blocks, {"layers": 4}) == []
        recs = tier.probe("ns-acl", toks, BS)
        assert [r.block for r in recs] == [n for n, _ in blocks]
        assert [(r.start, r.end) for r in recs] == [(i * BS, (i + 1) * BS) for i in range(5)]
        assert recs[0].layout == {"layers": 4}
        assert tier.get_blocks([r.block for r in recs]) == values
        assert tier.probe("ns-acl", toks[: 3 * BS + 10], BS) == recs[:3]  # a shorter prompt: its own blocks
        assert tier.probe("ns-acl", toks[:BS - 1], BS) == []
        assert tier.probe("ns-other", toks, BS) == []
        c = server.client()
        c.expire(KeySpace().block(blocks[0][0]), 50)
        assert publish(tier, "ns-acl", toks, blocks) == []
        s = tier.stats()
        assert (s["blocks_uploaded"], s["blocks_skipped"], s["hits"], s["errors"]) == (5, 5, 5, 0)
        assert c.ttl(KeySpace().block(blocks[0][0])) > 3600  # refreshed by the second publication
        c.expire(KeySpace().block(blocks[1][0]), 50)
        assert tier.get_blocks([blocks[1][0]]) == [values[1]]
        assert c.ttl(KeySpace().block(blocks[1][0])) > 3600  # and by a read: blocks in use stay
        assert s["get_bandwidth_bytes_per_s"] > 0 and s["latency_s"] > 0


def test_round_trip_with_default_user_password(server):
    values, blocks = blocks_of(2)
    toks = tokens_for(2, seed=2)
    with RemoteTier(f"redis://:{PW}@127.0.0.1:{server.port}/0", secret=SECRET) as tier:
        assert publish(tier, "ns-default", toks, blocks) == []
        assert tier.get_blocks([r.block for r in tier.probe("ns-default", toks, BS)]) == values


def test_round_trip_on_a_cluster(cluster):
    values, blocks = blocks_of(24, size=64 * 1024)
    toks = tokens_for(24, seed=3)
    with RemoteTier(cluster.url(USER, USER_PW), secret=SECRET) as tier:
        assert publish(tier, "ns-cluster", toks, blocks) == []
        recs = tier.probe("ns-cluster", toks, BS)  # pipelined batches of 16 keys spread over 3 nodes
        assert len(recs) == 24 and tier.get_blocks([r.block for r in recs]) == values
        assert all(n.client().dbsize() > 0 for n in cluster.nodes)  # keys spread: no hash tag pins them
        assert publish(tier, "ns-cluster", toks, blocks) == []
        s = tier.stats()
        assert (s["blocks_uploaded"], s["blocks_skipped"], s["cluster"], s["errors"]) == (24, 24, True, 0)
        assert tier.remove("ns-cluster", toks, BS) == 24 and tier.probe("ns-cluster", toks, BS) == []


def test_wrong_mac_key_and_replayed_records_are_rejected(server):
    values, blocks = blocks_of(3)
    toks = tokens_for(3, seed=4)
    with RemoteTier(server.url(USER, USER_PW), secret=SECRET) as writer:
        assert publish(writer, "ns-mac", toks, blocks) == []
        for reader_secret in (b"someone else's secret key", None):
            with RemoteTier(server.url(USER, USER_PW), secret=reader_secret) as reader:
                assert reader.probe("ns-mac", toks, BS) == []
                assert reader.stats()["mac_rejected"] == 1
        # A valid record copied under another prompt's key does not verify there.
        ks, other = KeySpace(), tokens_for(3, seed=5)
        k_src = prefix_keys(namespace_root("ns-mac"), toks, BS)[0]
        k_dst = prefix_keys(namespace_root("ns-mac"), other, BS)[0]
        c = server.client()
        c.set(ks.record(k_dst), c.get(ks.record(k_src)))
        assert writer.probe("ns-mac", other, BS) == [] and writer.stats()["mac_rejected"] == 1


def test_tampered_short_or_missing_blocks_are_misses(server):
    values, blocks = blocks_of(4)
    toks = tokens_for(4, seed=6)
    names = [n for n, _ in blocks]
    c, ks = server.client(), KeySpace()
    with RemoteTier(server.url(USER, USER_PW), secret=SECRET) as tier:
        assert publish(tier, "ns-tamper", toks, blocks) == []
        flipped = bytearray(values[2])
        flipped[1000] ^= 1
        for bad in (bytes(flipped), values[2][:-1], None):
            c.set(ks.block(names[2]), bad) if bad is not None else c.unlink(ks.block(names[2]))
            with pytest.raises(RemoteMiss) as miss:
                tier.get_blocks(names)
            assert miss.value.blocks == values[:2]  # the verified blocks before the bad one
        with pytest.raises(RemoteMiss, match="not a block name"):
            tier.get_blocks(["../etc/passwd"])
        assert tier.stats()["errors"] == 0 and tier.stats()["breaker"] == "ok"  # a miss is not an outage


def test_bad_local_block_publishes_the_prefix_before_it(server):
    values, blocks = blocks_of(4)
    toks = tokens_for(4, seed=7)

    def gone():
        raise FileNotFoundError("block file removed")

    blocks[2] = (blocks[2][0], gone)
    with RemoteTier(server.url(USER, USER_PW), secret=SECRET) as tier:
        failures = publish(tier, "ns-partial", toks, blocks)
        assert len(failures) == 1 and "could not be read" in failures[0] and "first 2 blocks" in failures[0]
        assert len(tier.probe("ns-partial", toks, BS)) == 2
        with pytest.raises(ValueError, match="full blocks"):
            tier.publish("ns-partial", toks[:BS], BS, blocks, {})


def test_deletes_use_unlink(server):
    values, blocks = blocks_of(2)
    toks = tokens_for(2, seed=8)
    c = server.client()
    with RemoteTier(server.url(USER, USER_PW), secret=SECRET) as tier:
        assert publish(tier, "ns-del", toks, blocks) == []
        c.config_resetstat()
        assert tier.remove_blocks([n for n, _ in blocks]) == 2 and tier.remove("ns-del", toks, BS) == 2
        stats = c.info("commandstats")
        assert stats["cmdstat_unlink"]["calls"] == 4 and "cmdstat_del" not in stats
        with pytest.raises(RemoteMiss):
            tier.get_blocks([blocks[0][0]])


def read_while_killed(tier: RemoteTier, names: list[str], victim: RedisServer):
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
    tier = RemoteTier(s.url(USER, USER_PW), secret=SECRET, timeout_s=2.0,
                      breaker=Breaker(threshold=3, base_s=0.5, cap_s=1.0))
    assert publish(tier, "ns-kill", toks, blocks) == []
    names = [r.block for r in tier.probe("ns-kill", toks, BS)]
    assert isinstance(read_while_killed(tier, names, s), RemoteMiss)
    for _ in range(3):
        assert isinstance(_outcome(tier.get_blocks, names), RemoteMiss)
    assert tier.stats()["breaker"].startswith("open until")
    t0 = time.perf_counter()
    assert tier.probe("ns-kill", toks, BS) == [] and not tier.worth_fetching(10_000, 20_000, 100.0)
    assert publish(tier, "ns-kill", toks, blocks) != []  # reported, not raised
    assert time.perf_counter() - t0 < 0.5  # an open breaker does not wait on the network
    s.start()  # the same port, empty: the breaker lets a trial through after its cool-down
    time.sleep(1.1)
    assert publish(tier, "ns-kill", toks, blocks) == [] and tier.stats()["breaker"] == "ok"
    assert tier.get_blocks(names) == values
    tier.close()


def test_killed_cluster_node_mid_read_is_a_miss(need_redis, tmp_path):
    c = RedisClusterNodes(tmp_path, password=PW, users=ACL).start()
    try:
        values, blocks = blocks_of(12, size=64 * 1024)
        toks = tokens_for(12, seed=10)
        tier = RemoteTier(c.url(USER, USER_PW), secret=SECRET, timeout_s=1.0)
        assert publish(tier, "ns-ckill", toks, blocks) == []
        names = [r.block for r in tier.probe("ns-ckill", toks, BS)]
        assert isinstance(read_while_killed(tier, names, c.nodes[1]), RemoteMiss)
        assert tier.stats()["errors"] >= 1
        t0 = time.perf_counter()
        assert isinstance(_outcome(tier.probe, "ns-ckill", toks, BS), list)
        assert isinstance(_outcome(tier.get_blocks, names), RemoteMiss)
        assert time.perf_counter() - t0 < 15
        tier.close()
    finally:
        c.stop()


def test_eviction_gives_misses_only(own_server):
    s = own_server(extra=("maxmemory 6mb", "maxmemory-policy allkeys-lru"))
    with RemoteTier(s.url(USER, USER_PW), secret=SECRET) as tier:
        published = []
        for i in range(10):
            values, blocks = blocks_of(4)
            toks = tokens_for(4, seed=100 + i)
            publish(tier, "ns-evict", toks, blocks)  # may report OOM-free success: LRU makes room
            published.append((toks, values))
        outcomes = []
        for toks, values in published:
            recs = tier.probe("ns-evict", toks, BS)
            got = _outcome(tier.get_blocks, [r.block for r in recs])
            assert isinstance(got, RemoteMiss) or got == values[: len(recs)]
            outcomes.append(len(recs) == 4 and not isinstance(got, RemoteMiss))
        assert s.client().info("stats")["evicted_keys"] > 0 and not all(outcomes)
        assert tier.stats()["errors"] == 0


def test_full_server_without_eviction_reports_failures(own_server):
    s = own_server(extra=("maxmemory 2mb", "maxmemory-policy noeviction"))
    values, blocks = blocks_of(12)
    with RemoteTier(s.url(USER, USER_PW), secret=SECRET) as tier:
        failures = publish(tier, "ns-oom", tokens_for(12, seed=11), blocks)
        assert failures and "OutOfMemoryError" in failures[0]


def test_timeout_is_a_miss(own_server):
    s = own_server()
    values, blocks = blocks_of(2)
    toks = tokens_for(2, seed=12)
    with RemoteTier(s.url(USER, USER_PW), secret=SECRET, timeout_s=0.3) as tier:
        assert publish(tier, "ns-slow", toks, blocks) == []
        names = [r.block for r in tier.probe("ns-slow", toks, BS)]
        s.client().client_pause(3000)
        t0 = time.perf_counter()
        with pytest.raises(RemoteMiss, match="Timeout"):
            tier.get_blocks(names)
        assert time.perf_counter() - t0 < 2.0


def test_credentials_never_shown(need_redis, server, caplog):
    caplog.set_level(logging.DEBUG)
    texts = []
    for url in (server.url(USER, "wrong-" + USER_PW), server.url(USER, USER_PW).replace(str(server.port), "1"),
                f"redis+cluster://{USER}:{USER_PW}@127.0.0.1:1"):
        tier = RemoteTier(url, secret=SECRET, breaker=Breaker(threshold=1))
        values, blocks = blocks_of(1, size=1024)
        texts += [str(_outcome(tier.get_blocks, [blocks[0][0]])), repr(tier), str(tier)]
        texts += publish(tier, "ns-creds", tokens_for(1), blocks)
        texts += [json.dumps(tier.stats()), str(_outcome(tier.probe, "ns-creds", tokens_for(1), BS))]
        assert tier.stats()["errors"] >= 1 and tier.stats()["last_error"]
        tier.close()
    texts.append(caplog.text)
    assert any("AuthenticationError" in t for t in texts) and any("Connection" in t for t in texts)
    assert_no_secrets(*texts)


def test_client_exceptions_do_not_escape(own_server):
    s = own_server()
    tier = RemoteTier(s.url(USER, USER_PW), secret=SECRET)
    s.stop()
    for call in (lambda: tier.get_blocks(["0" * 64]), lambda: tier.get_blocks([])):
        r = _outcome(call)
        assert r == [] or isinstance(r, RemoteMiss)
        assert not isinstance(r, redis.RedisError)
    tier.close()


def test_tls_round_trip_checks_the_certificate(need_redis, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make a test certificate)")
    files = make_tls_files(tmp_path / "tls")
    s = RedisServer(tmp_path / "s", password=PW, users=ACL, tls=files).start()
    try:
        values, blocks = blocks_of(2)
        toks = tokens_for(2, seed=13)
        url = s.url(USER, USER_PW, scheme="rediss")
        with RemoteTier(url, secret=SECRET, tls_ca_file=str(files["ca"])) as tier:
            assert publish(tier, "ns-tls", toks, blocks) == []
            assert tier.get_blocks([r.block for r in tier.probe("ns-tls", toks, BS)]) == values
            assert tier.stats()["tls"]
        with RemoteTier(url, secret=SECRET) as untrusting:  # the system CAs do not know the test CA
            miss = _outcome(untrusting.get_blocks, [blocks[0][0]])
            assert isinstance(miss, RemoteMiss) and "certificate" in str(miss).lower()
            assert_no_secrets(str(miss), json.dumps(untrusting.stats()))
        with RemoteTier(s.url(USER, USER_PW), secret=SECRET) as plain:  # no TLS: the server hangs up
            assert isinstance(_outcome(plain.get_blocks, [blocks[0][0]]), RemoteMiss)
        with pytest.raises(ValueError, match="not TLS"):
            RemoteTier(s.url(), tls_ca_file=str(files["ca"]))
    finally:
        s.stop()
