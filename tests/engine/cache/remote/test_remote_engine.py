"""The remote tier inside the engine, on real Redis and Valkey servers: engines with different
cache directories (different machines) share prefixes through the server.

Lookup order is RAM, SSD, remote; a remote hit continues exactly like a cold
run, is written through to the local SSD tier, and any remote trouble (a
killed server, a non-member's record, an evicted block, a dripping server)
is a miss with the same tokens. A shared tier is authenticated unless the
user opts out by name; teams never see each other; states that are exact
only at their own length (recurrent layers, a wrapped window) go remote
too. Credentials never show.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from redis_servers import KINDS, RedisClusterNodes, RedisServer, require
from drip_proxy import DripProxy
from remote_fixtures import PW, READER, READER_PW, SECRET, kind, server  # noqa: F401  (fixtures)
from tiny_archs import build_arch_model

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.models import registry as models_mod
from mlxcache_kernel.engine.cache.remote import TeamKeys
from mlxcache_kernel.engine.cache.remote.config import RemoteConfigError
from mlxcache_kernel.engine.cache.remote.keys import KeySpace

def prompt_ids(n: int, seed: int = 1) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


PROMPT = prompt_ids(300)  # 9 full blocks of 32 tokens below its last token


def engine(cache_dir, model_dir, url=None, secret=SECRET, **kw) -> Engine:
    eng = Engine(cache_dir=cache_dir, remote_url=url, remote_secret=secret, **kw)
    eng.load_model(model_dir, name="m")
    return eng


def run(eng: Engine, prompt=PROMPT):
    return eng.generate_tokens(prompt, max_tokens=8, model="m")


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
        assert s["remote_auth"].startswith("keyed (key id ")
        assert s["remote_kv_checked"] == 1 and s["remote_kv_mismatch"] == 0  # its first layer was recomputed
        b.flush()
        assert not b.cache.store.entries()  # not written through: on probation until recomputed here
        while b.cache.remote.verifier.busy:  # the idle time between cells
            b.poll()
        assert b.stats()["remote_verified"] == 1 and b.stats()["remote_forged"] == 0
        b.flush()  # verified: kept on this machine's SSD
        assert PW not in repr(s) and SECRET not in repr(s) and "127.0.0.1" in s["remote_url"]
        assert s["remote_state"] == "ok"
    # the same machine, no remote (and no prefetch): an SSD hit
    with engine(tmp_path / "b", tiny_model_dir, prefetch_budget_bytes=0) as local:
        again = run(local)
        assert again.stats["cache_source"] == "ssd" and again.tokens == cold.tokens


def test_no_secret_is_refused_and_the_insecure_opt_out_is_flagged(server, tiny_model_dir, tmp_path, monkeypatch):
    url = server.url(password=PW)
    monkeypatch.delenv("MLXCACHE_REMOTE_SECRET", raising=False)
    with pytest.raises(RemoteConfigError, match="no team secret.*MLXCACHE_REMOTE_INSECURE=1") as err:
        Engine(cache_dir=tmp_path / "x", remote_url=url)
    assert PW not in str(err.value) and not (tmp_path / "x").exists()  # refused before anything started
    monkeypatch.setenv("MLXCACHE_REMOTE_INSECURE", "1")
    with pytest.warns(UserWarning, match="UNAUTHENTICATED"):
        a = engine(tmp_path / "a", tiny_model_dir, url, secret=None)
    with a:
        cold = run(a)
        a.flush()
        assert "UNAUTHENTICATED" in a.stats()["remote_auth"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process, not per engine
        b = engine(tmp_path / "b", tiny_model_dir, url, secret=None)
    with b:
        hit = run(b)
        assert hit.stats["cache_source"] == "remote" and hit.tokens == cold.tokens
    with engine(tmp_path / "c", tiny_model_dir, url) as keyed:  # a team with a secret never reads the open space
        assert run(keyed).stats["cache_source"] is None


def test_two_teams_on_one_server_never_see_or_break_each_other(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    other = "the-other-teams-secret-SECRET"
    with engine(tmp_path / "a", tiny_model_dir, url) as a:
        cold = run(a)
        assert a.flush()["remote_failed"] == []
    with engine(tmp_path / "b", tiny_model_dir, url, secret=other) as b:
        r = run(b)
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens
        assert b.flush()["remote_failed"] == [] and b.stats()["remote_mac_rejected"] == 0
    for name, secret in (("a2", SECRET), ("b2", other)):  # both teams' records are there, each its own
        with engine(tmp_path / name, tiny_model_dir, url, secret=secret) as e:
            hit = run(e)
            assert hit.stats["cache_source"] == "remote" and hit.tokens == cold.tokens
            assert e.stats()["remote_mac_rejected"] == 0


def test_a_non_members_record_at_the_victims_prefix_key_is_a_miss(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    other = prompt_ids(300, seed=7)
    with engine(tmp_path / "a", tiny_model_dir, url) as a:
        cold = run(a)
        run(a, other)
        assert a.flush()["remote_failed"] == []
        ns = a.models.get("m").namespace
    # The attacker can write to the server and (worst case) knows which keys are the victim's:
    # it copies the records of another prompt over this prompt's records.
    space, keys = KeySpace(TeamKeys(SECRET.encode())), TeamKeys(SECRET.encode())
    c = server.client()
    for k_to, k_from in zip(keys.prefix_keys(ns, PROMPT[:288], 32), keys.prefix_keys(ns, other[:288], 32)):
        c.set(space.record(k_to), c.get(space.record(k_from)))
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        r = run(b)
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens
        assert b.stats()["remote_mac_rejected"] >= 1


def test_read_only_user_gets_hits_and_its_publications_fail_quietly(server, tiny_model_dir, tmp_path):
    with engine(tmp_path / "a", tiny_model_dir, server.url(password=PW)) as a:
        cold = run(a)
        a.flush()
    with engine(tmp_path / "b", tiny_model_dir, server.url(READER, READER_PW)) as b:
        hit = run(b)
        assert hit.stats["cache_source"] == "remote" and hit.tokens == cold.tokens
        other = run(b, prompt_ids(300, seed=3))  # published by b: denied, reported, never raised
        failed = b.flush()["remote_failed"]
        assert other.tokens and failed and all("NoPermission" in f for f in failed)
        assert READER_PW not in str(failed) and b.stats()["remote_state"] == "ok"


def test_a_dripping_server_is_abandoned_and_close_is_bounded(server, tiny_model_dir, tmp_path):
    with engine(tmp_path / "a", tiny_model_dir, server.url(password=PW)) as a:
        cold = run(a)
        a.flush()
    proxy = DripProxy(server.port)
    try:
        b = engine(tmp_path / "b", tiny_model_dir, f"redis://:{PW}@127.0.0.1:{proxy.port}")
        r = run(b)  # deadline: the default prefill rate's 2.9 s over the margin of 1.5
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens
        assert b.stats()["remote_deadline_missed"] >= 1
        with pytest.warns(UserWarning, match="publication"):  # its own publication drips: named at close
            report = b.close()
        assert report["remote_failed"]
    finally:
        proxy.close()


@pytest.mark.parametrize("arch", ["mamba2", "gemma3_text", "qwen3_next"])
def test_recurrent_and_wrapped_states_go_remote(server, arch, tmp_path):
    """Exact-only states (mamba: recurrent only; gemma 3: a window of 32 that wraps; qwen3-next:
    recurrent beside attention spans) are published whole and found by a prompt they prefix."""
    model_dir = build_arch_model(arch, tmp_path / "model")
    url = server.url(password=PW)
    longer = PROMPT + prompt_ids(40, seed=9)
    with Engine(cache_dir=tmp_path / "ref", ssd=False) as ref:
        ref.load_model(model_dir, name="m")
        cold = {len(p): ref.generate_tokens(p, max_tokens=8, use_cache=False).tokens
                for p in (PROMPT, longer)}
    with engine(tmp_path / "a", model_dir, url) as a:
        assert run(a).tokens == cold[len(PROMPT)]
        assert a.flush()["remote_failed"] == [] and a.stats()["remote_published"] >= 1
    for name, prompt in (("b", PROMPT), ("c", longer)):
        with engine(tmp_path / name, model_dir, url) as e:
            hit = run(e, prompt)
            assert hit.stats["cache_source"] == "remote" and hit.stats["remote_tokens"] == len(PROMPT) - 1
            assert hit.tokens == cold[len(prompt)], name


def test_another_backend_is_another_namespace(server, tiny_model_dir, tmp_path, monkeypatch):
    url = server.url(password=PW)
    with engine(tmp_path / "a", tiny_model_dir, url) as a:
        cold = run(a)
        a.flush()
        assert "(CPU)" in a.models.get("m").identity["runtime"]
    monkeypatch.setattr(models_mod, "backend", lambda: "CUDA")  # the same model, computed elsewhere
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        assert "(CUDA)" in b.models.get("m").identity["runtime"]
        r = run(b)
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens


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
    for key in c.scan_iter(match="*:blk:*"):  # what maxmemory eviction does to a block
        c.delete(key)
    with engine(tmp_path / "b", tiny_model_dir, url) as b:
        r = run(b)
        assert r.stats["cache_source"] is None and r.tokens == cold.tokens
        assert b.stats()["remote_misses"] >= 1


def test_cluster_of_three_nodes(kind, tiny_model_dir, tmp_path):
    nodes = RedisClusterNodes(tmp_path / "cluster", password=PW, kind=kind).start()
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


def test_bad_settings_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(RemoteConfigError) as e:
        Engine(cache_dir=tmp_path / "x", remote_url="http://user:hunter2-SECRET@host:1", remote_secret=SECRET)
    assert "hunter2" not in str(e.value)
    with pytest.raises(ValueError, match="publish"):
        Engine(cache_dir=tmp_path / "y", remote_url="redis://127.0.0.1:1", remote_secret=SECRET,
               remote_publish="sometimes")
    with pytest.raises(ValueError, match="16 bytes"):
        Engine(cache_dir=tmp_path / "z", remote_url="redis://127.0.0.1:1", remote_secret="short")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    monkeypatch.setenv("MLXCACHE_REMOTE_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(RemoteConfigError, match="cannot read") as e:
        Engine(cache_dir=tmp_path / "w", remote_url="redis://127.0.0.1:1")
    monkeypatch.setenv("MLXCACHE_REMOTE_SECRET_FILE", str(secret_file))
    with Engine(cache_dir=tmp_path / "v", remote_url="redis://127.0.0.1:1") as eng:  # never contacted
        assert eng.stats()["remote_auth"].startswith(f"keyed (key id {TeamKeys(SECRET.encode()).key_id})")


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

    def killed_first(self, *args, **kw):  # the records were found; the server dies before the blocks come
        server.kill()
        return read_blocks(self, *args, **kw)

    monkeypatch.setattr(RemoteTier, "get_blocks", killed_first)
    b = engine(tmp_path / "b", tiny_model_dir, url)
    r = run(b)
    assert r.stats["cache_source"] is None and r.tokens == cold.tokens
    s = b.stats()
    assert s["remote_misses"] == 1 and s["remote_hits"] == 0 and PW not in str(s)
    with pytest.warns(UserWarning, match="failed or not finished at close") as said:  # its own publication
        b.close()
    assert PW not in str(said[0].message)


NOTEBOOK_CELLS = [
    "%config MLXCache", "%config MLXCache.remote_url", "%cache config",
    "%%generate --max-tokens 4\nHello there, tell me a story about the sea and a lighthouse keeper.",
    "%cache flush", "%cache stats", "%env", "%env MLXCACHE_REMOTE_PASSWORD", "%env MLXCACHE_REMOTE_URL",
    "from mlxcache_kernel import get_engine\neng = get_engine()\n"
    "w = eng.cache.remote.tier.writer._client  # the publication's redis-py client\n"
    "eng.cache.remote.tier, w, w.connection_pool, eng.stats()['remote_url']",
    "import logging\nlogging.getLogger('mlxcache_kernel').warning('%s', get_engine().cache.remote.tier)",
    "%dashboard",
]


def test_no_credential_in_a_notebook_run_on_the_kernel(tiny_model_dir, spec_prefix, tmp_path):
    """The password (in the URL and in $MLXCACHE_REMOTE_PASSWORD) and the secret never reach a
    cell's output, the widget state or anything else nbformat saves."""
    import os

    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager

    from mlxcache_kernel.runner import execute_notebook

    require("redis")
    server = RedisServer(tmp_path / "redis", password=PW).start()
    try:
        env = dict(os.environ, MLXCACHE_CACHE_DIR=str(tmp_path / "cache"), MLXCACHE_DEFAULT_MODEL=str(tiny_model_dir),
                   MLXCACHE_REMOTE_URL=server.url("default", PW), MLXCACHE_REMOTE_PASSWORD=PW,
                   MLXCACHE_REMOTE_SECRET=SECRET, JUPYTER_PLATFORM_DIRS="1")
        path = tmp_path / "credentials.ipynb"
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS]), path)
        ksm = KernelSpecManager(kernel_dirs=[str(spec_prefix / "share" / "jupyter" / "kernels")])
        nbformat.write(execute_notebook(path, env=env, kernel_spec_manager=ksm, timeout=300), path)
        saved = path.read_text()
        assert f"redis://***@127.0.0.1:{server.port}" in saved  # the cells ran and showed the tier
        assert "remote_auth" in saved and "key id" in saved and "MLXCACHE_REMOTE_PASSWORD" in saved
        assert "ConnectionPool" in saved and "<REDACTED>" in saved  # redis>=7.4 hides the password
        for secret in (PW, SECRET):
            assert secret not in saved, f"{secret!r} saved in the notebook"
        assert server.client().dbsize() > 0  # and the tier was used: the generation was published
    finally:
        server.stop()
