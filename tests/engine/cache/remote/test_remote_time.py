"""Secrets and time (issue 30): weak secrets are refused and every secret is stretched (scrypt) so
the key id in every key name is no fast offline oracle; a secret can carry a not-after date; a
record older than the maximum age (7 days) or more than a few minutes in the future is a miss."""

from __future__ import annotations

import hashlib
import time

import blake3
import pytest

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.cache.remote import RemoteTier, TeamKeys
from mlxcache_kernel.engine.cache.remote.keys import SCRYPT, _context, stretch
from mlxcache_kernel.engine.cache.remote.records import MAX_AGE_S, MAX_SKEW_S, RemoteRecord, seal_chain, unseal

GOOD, NEW = "fA9x-team-secret-Kq2m-0001", "Zr7p-new-team-secret-W3e1"
URL = "redis://127.0.0.1:1"  # never contacted


@pytest.mark.parametrize("weak", ["aaaaaaaaaaaaaaaaaaaa", "abababababababababab", "1234123412341234"])
def test_a_weak_secret_is_refused_with_the_way_to_make_one(weak, tmp_path):
    with pytest.raises(ValueError, match="openssl rand -base64 32") as err:
        Engine(cache_dir=tmp_path / "x", remote_url=URL, remote_secret=weak)
    assert weak not in str(err.value)
    with pytest.raises(ValueError, match="distinct"):
        RemoteTier(URL, secret=weak)


def test_every_key_derives_from_the_stretched_secret():
    want = hashlib.scrypt(GOOD.encode(), salt=_context("secret stretch").encode(), dklen=32, maxmem=64 << 20, **SCRYPT)
    assert stretch(GOOD.encode()) == want
    fast = blake3.blake3(GOOD.encode(), derive_key_context=_context("key id")).hexdigest()[:12]
    slow = blake3.blake3(want, derive_key_context=_context("key id")).hexdigest()[:12]
    assert TeamKeys(GOOD.encode()).key_id == slow != fast  # guessing a phrase costs a scrypt per guess


def test_a_secret_past_its_not_after_date_is_neither_read_nor_used():
    with RemoteTier(URL, secret=f"{NEW}\nnot-after=2000-01-31 {GOOD}") as t:
        assert [k.key_id for k in t.keys] == [TeamKeys(NEW.encode()).key_id]
    with RemoteTier(URL, secret=f"not-after=2999-12-31 {NEW}\n{GOOD}") as t:
        assert len(t.keys) == 2 and t.keys[0].not_after > time.time() and t.keys[1].not_after is None
    with pytest.raises(ValueError, match="not-after date"):
        RemoteTier(URL, secret=f"not-after=2000-01-31 {GOOD}")
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        RemoteTier(URL, secret=f"not-after=2000-13-45 {GOOD}")


def test_old_and_future_records_are_stale():
    team, key, now = TeamKeys(GOOD.encode()), bytes(32), time.time()
    rec = RemoteRecord(0, 0, 32, "ab" * 32, "ns", b"{}")

    def read(issued):
        return unseal("c", key, seal_chain(key, rec, "{}", team, issued), team, now=now)[1]

    assert read(now) is None and read(now - MAX_AGE_S + 60) is None and read(now + 60) is None
    assert read(now - MAX_AGE_S - 60) == "stale"  # a replayed record from last week
    assert read(now + MAX_SKEW_S + 60) == "stale"  # stamped a few minutes ahead
    assert MAX_AGE_S <= 7 * 86400 and MAX_SKEW_S <= 600
