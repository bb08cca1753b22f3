"""Engine.objects on the remote tier, on real Redis and Valkey servers: engines with different cache
directories (different machines) share exact tensor objects; anything wrong on the server is a miss."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest
from object_values import assert_same, every_kind
from remote_fixtures import PW, SECRET, kind, server  # noqa: F401  (fixtures)

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.cache.objects.cache import namespace_of
from mlxcache_kernel.engine.cache.remote import TeamKeys
from mlxcache_kernel.engine.cache.remote.keys import AEAD_OVERHEAD, KeySpace
from mlxcache_kernel.engine.cache.objects.values import digest
from mlxcache_kernel.engine.cache.remote.records import OBJECT, unseal
from mlxcache_kernel.engine.cache.remote.writers import SigningKey


def engine(cache_dir, url, secret=SECRET, **kw) -> Engine:
    return Engine(cache_dir=cache_dir, remote_url=url, remote_secret=secret, **kw)


def big():
    return {"x": mx.random.normal((3 << 20,), key=mx.random.key(5)), "small": np.arange(3)}  # 12 MiB: 3+ chunks


def test_a_second_machine_gets_objects_from_the_remote_and_writes_them_through(server, tmp_path):
    url = server.url(password=PW)
    with engine(tmp_path / "a", url) as a:
        a.objects.put(("every", 1), every_kind())
        a.objects.put(("big", 1), big(), label="features")
        assert a.flush()["remote_failed"] == [] and a.stats()["remote_published"] == 2
    with engine(tmp_path / "b", url) as b:
        got, source = b.objects.lookup(("every", 1))
        assert source == "remote"
        assert_same(every_kind(), got)
        got, source = b.objects.lookup(("big", 1))
        assert source == "remote"
        assert_same(big(), got)
        s = b.stats()
        assert s["object_remote_hits"] == 2 and s["remote_bytes_read"] >= 12 << 20
        assert [r["label"] for r in b.objects.entries() if r["label"] == "features"] == ["features"]
        assert b.flush()["remote_failed"] == []  # written through, never republished as b's own
        assert b.stats()["remote_blocks_uploaded"] == 0
    with Engine(cache_dir=tmp_path / "b") as b2:  # no remote now: from b's own SSD
        got, source = b2.objects.lookup(("big", 1))
        assert source == "ssd"
        assert_same(big(), got)
    with engine(tmp_path / "c", url) as c:
        assert c.objects.lookup(("big", 2)) == (None, None)  # another key: a miss


def test_other_teams_and_bad_chunks_are_misses(server, tmp_path):
    url = server.url(password=PW)
    with engine(tmp_path / "a", url) as a:
        a.objects.put("k", big())
        assert a.flush()["remote_failed"] == []
    with engine(tmp_path / "b", url, secret="the-other-teams-secret-SECRET") as b:
        assert b.objects.get("k") is None and b.stats()["object_misses"] == 1  # never sees another team's
    c = server.client()
    space = KeySpace(TeamKeys(SECRET.encode()))
    chunk_keys = [k for k in c.scan_iter(match=space.block("*").rsplit(":", 1)[0] + ":*")
                  if c.strlen(k) == (4 << 20) + AEAD_OVERHEAD]  # a 4 MiB chunk, encrypted
    assert chunk_keys
    value = bytearray(c.get(chunk_keys[0]))
    value[7] ^= 1  # the same size, other bytes
    c.set(chunk_keys[0], bytes(value))
    with engine(tmp_path / "d", url) as d:
        assert d.objects.get("k") is None  # a chunk that does not verify: a miss, removed from the server
        s = d.stats()
        assert s["object_restore_failures"] == 1 and s["remote_bad_blocks"] == 1
        d.objects.put("k", big())  # computed again: published again
        assert d.flush()["remote_failed"] == []
    with engine(tmp_path / "e", url) as e:
        assert_same(big(), e.objects.get("k"))
    root = TeamKeys(SECRET.encode()).root(namespace_of(digest("k")))
    c.set(space.object(root), c.get(space.object(root))[:-3] + b"xyz")  # a tampered record
    with engine(tmp_path / "f", url) as f:
        assert f.objects.get("k") is None and f.stats()["remote_mac_rejected"] == 1


def test_a_killed_server_is_a_miss(server, tmp_path):
    url = server.url(password=PW)
    with engine(tmp_path / "a", url) as a:
        a.objects.put("k", big())
        a.flush()
    server.kill()
    with pytest.warns(UserWarning, match="publication.*not finished at close: publish object"):
        with engine(tmp_path / "b", url) as b:
            assert b.objects.lookup("k") == (None, None)
            b.objects.put("k", big())  # still stored locally; its publication fails, reported at close
            assert b.objects.lookup("k")[1] == "ram"


def test_an_objects_writer_follows_it_revoked_or_replaced(server, tmp_path):
    """Origins for objects (issue 30): a member that got an object from the remote never publishes it
    as its own; when its writer is revoked, the member's SSD copy goes; a value it puts itself is its own."""
    alice, bob = SigningKey.generate(), SigningKey.generate()
    both = f"alice={alice.public_text()},bob={bob.public_text()}"
    url, keys = server.url(password=PW), TeamKeys(SECRET.encode())
    name, root = KeySpace(keys).object(keys.root(namespace_of(digest("k")))), keys.root(namespace_of(digest("k")))

    def writer_on_server() -> str:
        return unseal(OBJECT, root, server.client().get(name), keys, now=time.time())[0].writer

    with engine(tmp_path / "a", url, remote_signing_key=alice, remote_writers=both) as a:
        a.objects.put("k", big())
        assert a.flush()["remote_failed"] == []
    with engine(tmp_path / "b", url, remote_signing_key=bob, remote_writers=both) as b:
        assert b.objects.lookup("k")[1] == "remote"
        assert b.flush()["remote_failed"] == [] and b.stats()["remote_not_republished"] == 1
    assert writer_on_server() == alice.id.hex()  # still alice's record: bob did not re-sign it
    with engine(tmp_path / "b", url, remote_signing_key=bob, remote_writers=f"bob={bob.public_text()}") as b:
        assert b.stats()["remote_revoked_dropped"] == 1  # alice revoked: her object left bob's SSD
        assert b.objects.where("k") is None and b.objects.lookup("k") == (None, None)
        b.objects.put("k", {"mine": np.arange(4)})  # bob's own value under the same key
        assert b.flush()["remote_failed"] == [] and b.stats()["remote_published"] == 1
    assert writer_on_server() == bob.id.hex()
    with engine(tmp_path / "b", url, remote_signing_key=bob, remote_writers=f"bob={bob.public_text()}") as b:
        assert b.stats()["remote_revoked_dropped"] == 0 and b.objects.where("k") == "ssd"  # its own stays
