"""Trust, then verify, before keeping (issue 49), on real Redis and Valkey servers.

A listed writer publishes, for a prompt, KV whose first layer is honest (so the first-layer check
passes) and whose deeper layers are another prompt's. Through the public publish path only: the
forger's engine commits the forged checkpoint and its publisher uploads it, signed by its key.
The victim may serve the cell that asked, but never keeps the state on SSD; the idle-time
recomputation finds it wrong, names the writer and the cells that used it, drops it, and stops
trusting that writer; later cells run cold or on verified state.
"""

from __future__ import annotations

import itertools
import json

from remote_fixtures import PW, kind, server  # noqa: F401  (fixtures)
from test_remote_writers import ALICE, FORGER, P1, P2, P3, cold_tokens, engine, listed, measured_slow, run, verified

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.kv.checkpoint import Checkpoint

N = 256  # the forged prefix: 8 full blocks


def state_of(eng: Engine, prompt) -> Checkpoint:
    run(eng, prompt)
    ns, tokens = eng.last_key
    return eng.cache.get_exact(tokens, ns).checkpoint.prefix(N)


def publish_poisoned(tmp_path, model_dir, url) -> None:
    """The forger: P1's first layer, P2's layers 1 and up, under P1's tokens, signed and published."""
    with Engine(cache_dir=tmp_path / "scratch", ssd=False) as scratch:
        scratch.load_model(model_dir, name="m")
        honest, other = state_of(scratch, P1), state_of(scratch, P2)
        forged = Checkpoint.of_layers(honest.tokens, (honest.layers[0],) + tuple(other.layers[1:]))
        with engine(tmp_path / "forger", model_dir, url, FORGER, listed(ALICE, FORGER)) as forger:
            ns = forger.models.get("m").namespace
            assert ns == scratch.models.get("m").namespace
            forger.cache.put(forged, ns)
            assert forger.flush()["remote_failed"] == [] and forger.stats()["remote_published"] == 1


def held_on_ssd(eng: Engine, prompt) -> list:
    return [e for e in eng.cache.store.entries() if tuple(e.tokens[:32]) == tuple(prompt[:32])]


def victim_engine(path, model_dir, url, sampled: int = 0) -> Engine:
    eng = engine(path, model_dir, url, None, listed(ALICE, FORGER), prefetch_budget_bytes=0)
    measured_slow(eng)
    v = eng.cache.remote.verifier
    v.sampled_positions = sampled
    cells = itertools.count(1)
    v.cell = lambda: f"In [{next(cells)}]"
    return eng


def test_poisoned_deep_layers_serve_one_cell_are_never_kept_and_name_their_writer(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    cold1, cold3 = cold_tokens(tiny_model_dir, tmp_path, P1, P3)
    publish_poisoned(tmp_path, tiny_model_dir, url)
    victim_dir = tmp_path / "victim"
    with victim_engine(victim_dir, tiny_model_dir, url) as victim:
        first = run(victim, P1)
        assert first.stats["cache_source"] == "remote"  # trusted for the cell that asked (the sample is off here)
        assert victim.stats()["remote_kv_checked"] == 1  # layer 0 is honest: the first-layer check passes
        victim.flush()
        assert held_on_ssd(victim, P1) == []  # not written through: on probation
        second = run(victim, P1)  # a next cell before the idle time came: told as the remote's, not RAM's
        assert second.stats["cache_source"] == "remote"
        victim.flush()
        assert held_on_ssd(victim, P1) == []
        verified(victim)
        s = victim.stats()
        assert s["remote_forged"] == 1 and s["remote_verified"] == 0
        alert, = victim.cache.remote.verifier.alerts
        assert "w1" in alert and "In [1], In [2]" in alert and "layer " in alert  # the forger, by its listed name
        evidence, = (victim_dir / "checkpoints" / "remote-evidence").glob("*.json")
        e = json.loads(evidence.read_text())
        assert e["writer"] == FORGER.id.hex() and e["layer"] >= 1 and 0 <= e["position"] < N
        assert e["record"]["signature"] and e["cells"] == ["In [1]", "In [2]"]
        assert held_on_ssd(victim, P1) == [] and not [x for x in victim.cache.entries() if x.tokens[:32] == tuple(P1[:32])]
        later = run(victim, P1)  # dropped here, the forger's records refused: cold
        assert later.stats["cache_source"] is None and later.tokens == cold1
        assert victim.stats()["remote_distrusted"] >= 1
    with engine(tmp_path / "alice", tiny_model_dir, url, ALICE, listed(ALICE, FORGER)) as alice:
        run(alice, P3)
        assert alice.flush()["remote_failed"] == []
    with victim_engine(victim_dir, tiny_model_dir, url) as victim:  # after a restart: still distrusted
        again = run(victim, P1)
        assert again.stats["cache_source"] != "remote" and again.tokens == cold1
        honest = run(victim, P3)  # an honest writer's state: served, verified, then kept
        assert honest.stats["cache_source"] == "remote" and honest.tokens == cold3
        victim.flush()
        assert held_on_ssd(victim, P3) == []
        verified(victim)
        assert victim.stats()["remote_verified"] == 1
        victim.flush()
        assert held_on_ssd(victim, P3) != []


def test_the_sampled_check_refuses_a_state_poisoned_throughout_before_any_cell_uses_it(server, tiny_model_dir,
                                                                                       tmp_path):
    url = server.url(password=PW)
    cold1, = cold_tokens(tiny_model_dir, tmp_path, P1)
    publish_poisoned(tmp_path, tiny_model_dir, url)
    with victim_engine(tmp_path / "victim", tiny_model_dir, url, sampled=4) as victim:
        r = run(victim, P1)
        assert r.stats["cache_source"] is None and r.tokens == cold1
        s = victim.stats()
        assert s["remote_forged"] == 1 and s["remote_hits"] == 0 and s["remote_sampled"] == 1
        alert, = victim.cache.remote.verifier.alerts
        assert "w1" in alert and "caught before use" in alert
        assert not victim.cache.remote.verifier.busy and held_on_ssd(victim, P1) == []
