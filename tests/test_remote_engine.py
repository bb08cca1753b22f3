"""The remote tier inside the engine, on real redis-server processes: two engines
with different cache directories (two machines) share a prefix through Redis.

Lookup order is RAM, SSD, remote; a remote hit continues exactly like a cold
run, is written through to the local SSD tier, and any remote trouble (a
killed server, a record written without the team secret, an evicted block)
is a miss with the same tokens. Credentials never show.
"""

from __future__ import annotations

import numpy as np
import pytest
from redis_servers import RedisClusterNodes, RedisServer, missing

from mlxcache_kernel.engine import Engine, SamplingParams
from mlxcache_kernel.engine.cache.remote.config import RemoteConfigError

PW = "team-pw-61d2-SECRET"
SECRET = "team-mac-secret-SECRET"


@pytest.fixture(scope="module")
def need_redis():
    why = missing()
    if why:
        pytest.skip(why)


@pytest.fixture
def server(need_redis, tmp_path):
    s = RedisServer(tmp_path / "redis", password=PW).start()
    yield s
    s.stop()


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


PROMPT = prompt_ids(300)  # 9 full blocks of 32 tokens below its last token


def engine(cache_dir, model_dir, url=None, secret=SECRET, **kw) -> Engine:
    eng = Engine(cache_dir=cache_dir, remote_url=url, remote_secret=secret, **kw)
    eng.load_model(model_dir, name="m")
    return eng


def run(eng: Engine, prompt=PROMPT):
    return eng.generate_tokens(prompt, SamplingParams(max_tokens=8), model="m")


def test_second_machine_gets_a_remote_hit_with_the_cold_runs_tokens(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    with engine(tmp_path / "a", tiny_model_dir, url) as a:
        cold = run(a)
        report = a.flush()
        assert report["remote_failed"] == [] and a.stats()["remote_blocks_uploaded"] >= 9
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        hit = run(b)
        assert hit.stats["cache_source"] == "remote" and hit.stats["remote_tokens"] == 9 * 32
        assert hit.tokens == cold.tokens
        s = b.stats()
        assert s["remote_hits"] == 1 and s["remote_bytes_read"] > 0 and s["engine_remote_tokens"] == 9 * 32
        b.flush()  # written through to this machine's SSD
        assert PW not in repr(s) and "127.0.0.1" in s["remote_url"] and s["remote_state"] == "ok"
    # the same machine, no remote (and no prefetch): an SSD hit
    with engine(tmp_path / "b", tiny_model_dir, prefetch_budget_bytes=0) as local:
        again = run(local)
        assert again.stats["cache_source"] == "ssd" and again.tokens == cold.tokens


def test_records_without_the_team_secret_are_rejected(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    with engine(tmp_path / "a", tiny_model_dir, url, secret="another-team-secret-0000") as a:
        cold = run(a)
        a.flush()
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        r = run(b)
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens
        assert b.stats()["remote_mac_rejected"] >= 1


def test_a_killed_server_is_a_miss_with_the_same_tokens(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    with engine(tmp_path / "a", tiny_model_dir, url) as a:
        cold = run(a)
        a.flush()
    server.kill()
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        r = run(b)
        r2 = run(b)  # the breaker stops calling the dead server; RAM serves the rerun
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens == r2.tokens
        s = b.stats()
        assert s["remote_errors"] >= 1 and PW not in str(s) and PW not in str(b.flush())


def test_evicted_blocks_are_misses(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    with engine(tmp_path / "a", tiny_model_dir, url) as a:
        cold = run(a)
        a.flush()
    c = server.client()
    for key in c.scan_iter(match="*blk*"):  # what maxmemory eviction does to a block
        c.delete(key)
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        r = run(b)
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens
        assert b.stats()["remote_misses"] >= 1


def test_cluster_of_three_nodes(need_redis, tiny_model_dir, tmp_path):
    nodes = RedisClusterNodes(tmp_path / "cluster", password=PW).start()
    try:
        url = nodes.url(password=PW)
        with engine(tmp_path / "a", tiny_model_dir, url) as a:
            cold = run(a)
            assert a.flush()["remote_failed"] == []
        with engine(tmp_path / "b", tiny_model_dir, url) as b:
            hit = run(b)
            assert hit.stats["cache_source"] == "remote" and hit.tokens == cold.tokens
    finally:
        nodes.stop()


def test_bad_urls_and_publish_modes_are_clear_errors(tiny_model_dir, tmp_path):
    with pytest.raises(RemoteConfigError) as e:
        Engine(cache_dir=tmp_path / "x", remote_url="http://user:hunter2-SECRET@host:1")
    assert "hunter2" not in str(e.value)
    with pytest.raises(ValueError, match="publish"):
        Engine(cache_dir=tmp_path / "y", remote_url="redis://127.0.0.1:1", remote_publish="sometimes")


def test_named_mode_publishes_only_named_checkpoints(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    with engine(tmp_path / "a", tiny_model_dir, url, remote_publish="named") as a:
        cold = run(a)
        assert a.flush()["remote_failed"] == [] and a.stats()["remote_blocks_uploaded"] == 0
        other = run(a, prompt_ids(300, seed=2))
        a.checkpoint_save("doc")  # the last generation's state, named: now it goes remote
        a.flush()
        assert a.stats()["remote_blocks_uploaded"] >= 9
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        assert run(b).stats["cache_source"] is None  # the unnamed one stayed local
        # A model that prefills far faster than the remote can be read (set, not measured: a
        # measured rate depends on how busy the machine is): the published prefix is skipped
        # (go remote only where it beats recompute)
        b.metrics.prefill_rate[b.models.get("m").namespace] = 1e9
        skipped = run(b, prompt_ids(300, seed=2))
        assert skipped.stats["cache_source"] is None and b.stats()["remote_skipped"] >= 1
    # A fresh machine, with no prefill rate measured yet, fetches it.
    with engine(tmp_path / "c", tiny_model_dir, url) as c:
        hit = run(c, prompt_ids(300, seed=2))
        assert hit.stats["cache_source"] == "remote" and hit.tokens == other.tokens != cold.tokens


def test_server_killed_between_probe_and_block_reads_is_a_miss(server, tiny_model_dir, tmp_path, monkeypatch):
    from mlxcache_kernel.engine.cache.remote.tier import RemoteTier

    url = server.url(password=PW)
    with engine(tmp_path / "a", tiny_model_dir, url) as a:
        cold = run(a)
        a.flush()
    read_blocks = RemoteTier.get_blocks

    def killed_first(self, names):  # the records were found; the server dies before the blocks come
        server.kill()
        return read_blocks(self, names)

    monkeypatch.setattr(RemoteTier, "get_blocks", killed_first)
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        r = run(b)
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens
        s = b.stats()
        assert s["remote_misses"] == 1 and s["remote_hits"] == 0 and PW not in str(s)
