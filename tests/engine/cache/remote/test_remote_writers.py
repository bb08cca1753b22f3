"""Who wrote it (issue 30), on real Redis and Valkey servers: per-writer Ed25519 signatures, the
team's allow-list, revocation (also of the copies members took to their SSD), and no laundering:
an entry fetched from the remote is never published again by the member that fetched it.

A forger here holds the team secret and uses the public publish API (span_publication + publish),
nothing patched: it publishes records for one prompt that name another prompt's blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from remote_fixtures import PW, SECRET, kind, server  # noqa: F401  (fixtures)

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.cache.remote.link import span_publication
from mlxcache_kernel.engine.cache.remote.records import seal_chain, unseal
from mlxcache_kernel.engine.cache.remote.tier import RemoteTier
from mlxcache_kernel.engine.cache.remote.writers import SigningKey, Writers
from mlxcache_kernel.engine.cache.ssd import blocks

ALICE, FORGER, BOB = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()


def prompt_ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


P1, P2, P3 = prompt_ids(300, 1), prompt_ids(300, 2), prompt_ids(300, 3)


def listed(*keys) -> str:
    return ",".join(f"w{i}={k.public_text()}" for i, k in enumerate(keys))


def engine(cache_dir, model_dir, url, key=None, writers=None, secret=SECRET, **kw) -> Engine:
    eng = Engine(cache_dir=cache_dir, remote_url=url, remote_secret=secret, remote_signing_key=key,
                 remote_writers=writers, **kw)
    eng.load_model(model_dir, name="m")
    return eng


def measured_slow(eng: Engine) -> None:
    """As if this model's prefill had been measured at 1 token/s: every fetch is worth it and its
    deadline is long, whatever one probe's round trip took on a busy machine (what the test is about
    is then the only thing that decides)."""
    eng.metrics.prefill_rate[eng.models.get("m").namespace] = 1.0


def run(eng: Engine, prompt):
    return eng.generate_tokens(prompt, max_tokens=8, model="m")


def verified(eng: Engine) -> None:
    """Let the idle time between cells recompute what was fetched (a remote state is kept on SSD only then)."""
    while eng.cache.remote.verifier.busy:
        eng.poll()


def cold_tokens(model_dir, tmp_path, *prompts):
    with Engine(cache_dir=tmp_path / "ref", ssd=False) as ref:
        ref.load_model(model_dir, name="m")
        return [ref.generate_tokens(p, max_tokens=8, use_cache=False).tokens for p in prompts]


def forge(eng: Engine, victim, source) -> None:
    """Through the public API: publish, for `victim`'s tokens, the blocks of `source`'s checkpoint
    (both run on `eng`), signed by eng's key."""
    run(eng, source)
    eng.flush()
    ns, tokens = eng.last_key
    info = eng.cache.store.file_info(ns, tokens)
    values, layout = span_publication(info, eng.cache.store.blocks_root)
    tier = eng.cache.remote.tier
    assert tier.publish(ns, victim[:len(values) * blocks.BLOCK_TOKENS], blocks.BLOCK_TOKENS, values, layout)
    assert tier.wait() == []


def test_signatures_bind_a_record_to_its_writer_and_the_names_of_its_whole_run():
    from mlxcache_kernel.engine.cache.remote import TeamKeys
    from mlxcache_kernel.engine.cache.remote.records import RemoteRecord, chain_signature, names_digest

    team, now, key = TeamKeys(SECRET.encode()), 1.7e9, bytes(range(32))
    d = names_digest(names_digest(b"", "aa" * 32), "bb" * 32)
    rec = RemoteRecord(1, 32, 64, "bb" * 32, "ns", b"{}")
    got, why = unseal("c", key, seal_chain(key, rec, "{}", team, now, ALICE, d), team, now=now)
    assert why is None and got.writer == ALICE.id
    assert chain_signature(key, got, d, Writers.parse(listed(ALICE))) is None
    assert chain_signature(key, got, d, Writers.parse(listed(BOB))) == "unknown_writer"
    other = names_digest(names_digest(b"", "cc" * 32), "bb" * 32)  # block 0 swapped under it
    assert chain_signature(key, got, other, Writers.parse(listed(ALICE))) == "signature"
    unsigned, _ = unseal("c", key, seal_chain(key, rec, "{}", team, now), team, now=now)
    assert chain_signature(key, unsigned, d, Writers.parse(listed(ALICE))) == "unknown_writer"
    assert "private" in repr(ALICE) and ALICE.seed_text() not in repr(ALICE) + str(ALICE)
    with pytest.raises(TypeError):
        __import__("pickle").dumps(ALICE)


def test_a_revoked_writers_forgery_is_a_miss_and_its_entries_leave_the_victims_ssd(server, tiny_model_dir,
                                                                                    tmp_path):
    url = server.url(password=PW)
    cold1, cold3 = cold_tokens(tiny_model_dir, tmp_path, P1, P3)
    with engine(tmp_path / "alice", tiny_model_dir, url, ALICE, listed(ALICE, FORGER)) as alice:
        assert run(alice, P1).tokens == cold1
        assert alice.flush()["remote_failed"] == []
    with engine(tmp_path / "forger", tiny_model_dir, url, FORGER, listed(ALICE, FORGER)) as forger:
        assert run(forger, P3).tokens == cold3  # an honest entry first, which the victim takes to its SSD
        forger.flush()
        victim_dir = tmp_path / "victim"
        with engine(victim_dir, tiny_model_dir, url, None, listed(ALICE, FORGER)) as victim:
            hit = run(victim, P3)
            assert hit.stats["cache_source"] == "remote" and hit.tokens == cold3
            verified(victim)
            victim.flush()
        forge(forger, P1, P2)  # then the forgery: P1's records name P2's blocks
    # The team revokes the forger: its records are misses, its entries leave the victim's SSD.
    with engine(victim_dir, tiny_model_dir, url, None, listed(ALICE), prefetch_budget_bytes=0) as victim:
        s = victim.stats()
        assert s["remote_revoked_dropped"] >= 1  # the P3 entry and what extended it
        r1, r3 = run(victim, P1), run(victim, P3)
        assert r1.tokens == cold1 and r1.stats["cache_source"] is None
        assert r3.tokens == cold3 and r3.stats["cache_source"] is None  # not from SSD, not from the remote
        assert victim.stats()["remote_unknown_writer"] >= 2
        assert victim.stats()["remote_published"] == 0  # a read-only member (no signing key) publishes nothing
    with engine(victim_dir, tiny_model_dir, url, None, listed(ALICE), prefetch_budget_bytes=0) as again:
        assert again.stats()["remote_revoked_dropped"] == 0  # swept once


def test_an_entry_fetched_from_the_remote_is_never_republished_across_a_rotation(server, tiny_model_dir, tmp_path):
    url, old, new = server.url(password=PW), "the-old-team-secret-SECRET", "the-new-team-secret-SECRET"
    cold1, = cold_tokens(tiny_model_dir, tmp_path, P1)
    with engine(tmp_path / "a", tiny_model_dir, url, ALICE, secret=old) as a:  # not yet rotated
        run(a, P1)
        assert a.flush()["remote_failed"] == []
    with engine(tmp_path / "m", tiny_model_dir, url, BOB, secret=f"{new}\n{old}") as m:  # rotating: seals with new
        hit = run(m, P1)
        assert hit.stats["cache_source"] == "remote" and hit.tokens == cold1
        run(m, P1 + hit.tokens[len(P1):] + prompt_ids(40, 9))  # a next turn, derived from the fetched entry
        verified(m)  # (kept, and so offered to the publisher, only once verified)
        assert m.flush()["remote_failed"] == []
        s = m.stats()
        assert s["remote_not_republished"] >= 2 and s["remote_published"] == 0
    with engine(tmp_path / "n", tiny_model_dir, url, BOB, secret=new) as n:  # only the new secret
        r = run(n, P1)
        assert r.stats["cache_source"] is None and r.tokens == cold1
    # Dropping the old secret revokes what m took under it.
    with engine(tmp_path / "m", tiny_model_dir, url, BOB, secret=new, prefetch_budget_bytes=0) as m:
        assert m.stats()["remote_revoked_dropped"] >= 2
        again = run(m, P1)  # not from its SSD; from the remote only as n published it (computed by n)
        assert again.stats["cache_source"] != "ssd" and again.tokens == cold1


def test_with_an_allow_list_only_listed_signers_are_read(server, tmp_path):
    url = server.url(password=PW)
    tier_kw = dict(secret=SECRET, timeout_s=2.0)
    value = b"v" * 4096
    from mlxcache_kernel.engine.cache.remote import Value, block_name

    toks, ns, bs = list(range(3, 3 + 128)), "ns-writers", 64
    blocks_ = [Value(block_name(value + bytes([i])), 4097, lambda i=i: value + bytes([i])) for i in range(2)]
    with RemoteTier(url, signing_key=FORGER, **tier_kw) as t:
        assert t.publish(ns, toks, bs, blocks_, {"layers": 1}) and t.wait() == []
    with RemoteTier(url, writers=listed(ALICE), **tier_kw) as t:
        assert t.probe(ns, toks, bs).records == [] and t.stats()["unknown_writer"] >= 1
        longer = toks + list(range(500, 500 + 3 * bs))  # a prompt that goes on past what is stored (every new cell)
        assert t.probe(ns, longer, bs).records == []  # the run ends early: still only a listed signer's
    with RemoteTier(url, writers=listed(ALICE, FORGER), **tier_kw) as t:
        found = t.probe(ns, toks, bs)
        assert len(found.records) == 2 and found.writer == FORGER.id.hex()
    with RemoteTier(url, **tier_kw) as t:  # no allow-list: any holder of the secret (MAC only)
        assert len(t.probe(ns, toks, bs).records) == 2
    with RemoteTier(url, writers=listed(ALICE), **tier_kw) as reader:
        assert reader.may_publish is False and reader.publish(ns, toks, bs, blocks_, {"layers": 1})
        assert reader.wait() == [] and reader.stats()["records_written"] == 0


def test_an_allow_listed_forgers_blocks_fail_the_first_layer_check(server, tiny_model_dir, tmp_path):
    """Signed by a writer the team trusts, P1's records name P2's blocks: the victim recomputes the
    first layer's keys and values for the restored positions, finds them another prompt's, and prefills."""
    url = server.url(password=PW)
    cold1, cold3 = cold_tokens(tiny_model_dir, tmp_path, P1, P3)
    team = listed(ALICE, FORGER)
    with engine(tmp_path / "forger", tiny_model_dir, url, FORGER, team) as forger:
        run(forger, P3)
        forger.flush()
        forge(forger, P1, P2)
    with engine(tmp_path / "victim", tiny_model_dir, url, None, team) as victim:
        r1 = run(victim, P1)
        assert r1.stats["cache_source"] is None and r1.tokens == cold1
        s = victim.stats()
        assert s["remote_kv_mismatch"] == 1 and s["remote_hits"] == 0
    with engine(tmp_path / "other", tiny_model_dir, url, None, team) as other:  # no prefill rate measured yet
        r3 = run(other, P3)  # the same writer's honest entry still serves, checked
        assert r3.stats["cache_source"] == "remote" and r3.tokens == cold3
        assert other.stats()["remote_kv_checked"] == 1 and other.stats()["remote_kv_mismatch"] == 0


def test_a_check_that_cannot_run_is_a_miss_and_a_sample_not_computed_ahead_is_computed_after(
        server, tiny_model_dir, tmp_path, monkeypatch):
    """The first-layer check's sample is computed while the blocks are read (first_layer.ahead). If
    that fails, the check computes it after the fetch; if the check itself fails (an allocation, an
    MLX error), the hit is a counted miss and the cell prefills: never an unchecked hit, never a failed cell."""
    from mlxcache_kernel.engine.kv import first_layer

    url = server.url(password=PW)
    cold3, = cold_tokens(tiny_model_dir, tmp_path, P3)
    with engine(tmp_path / "w", tiny_model_dir, url, ALICE, listed(ALICE)) as writer:
        run(writer, P3)
        writer.flush()

    def broken(*args, **kwargs):
        raise RuntimeError("[metal::malloc] out of memory")  # what an evaluation can raise

    monkeypatch.setattr(first_layer, "bound_to_tokens", broken)
    with engine(tmp_path / "a", tiny_model_dir, url, None, listed(ALICE)) as a:
        measured_slow(a)
        r = run(a, P3)
        s = a.stats()
        assert r.stats["cache_source"] is None and r.tokens == cold3
        assert s["remote_hits"] == 0 and s["remote_misses"] == 1 and s["remote_kv_checked"] == 0
        assert s["remote_kv_unchecked"] == 0 and s["remote_tokens"] == 0
    monkeypatch.undo()
    calls = []

    def sample_ahead_fails(m, tokens):
        calls.append(len(tokens))
        raise RuntimeError("no sample ahead")

    monkeypatch.setattr(first_layer, "ahead", sample_ahead_fails)
    with engine(tmp_path / "b", tiny_model_dir, url, None, listed(ALICE)) as b:
        measured_slow(b)
        r = run(b, P3)
        seen = {k: v for k, v in b.stats().items() if k.startswith("remote")}
        assert calls == [288], str(seen)  # asked for the tokens of the blocks to fetch (9 of 32), before reading them
        assert r.stats["cache_source"] == "remote" and r.tokens == cold3
        assert b.stats()["remote_kv_checked"] == 1
