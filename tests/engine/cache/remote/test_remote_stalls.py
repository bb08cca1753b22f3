"""A stalled server on the first lookup of a process (issue 30), on real Redis and Valkey: a proxy
that drips one byte a second, and a non-member pausing every client (CLIENT PAUSE). Until the
prefill rate is measured the lookup's deadline is capped (link.UNMEASURED_DEADLINE_S), so the cell
finishes within that cap plus its prefill (not ~15x its prefill, as at 100 tokens/s assumed); the
stall counts as a missed deadline and opens the breaker at once (not after three failures).

The bound checked is the cap plus the cell's own prefill plus a slack of 3 s for a loaded machine,
against ~20 s without the cap (2,976 candidate tokens at 100 tokens/s over a margin of 1.5).
"""

from __future__ import annotations

import time

import numpy as np
from drip_proxy import DripProxy
from remote_fixtures import PW, SECRET, kind, server  # noqa: F401  (fixtures)

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.cache.remote.link import UNMEASURED_DEADLINE_S

LONG = [int(x) for x in np.random.default_rng(5).integers(3, 259, 3000)]
SLACK_S = 3.0


def engine(cache_dir, model_dir, url) -> Engine:
    eng = Engine(cache_dir=cache_dir, remote_url=url, remote_secret=SECRET)
    eng.load_model(model_dir, name="m")
    return eng


def timed(eng, prompt):
    t0 = time.perf_counter()
    r = eng.generate_tokens(prompt, max_tokens=4, model="m")
    return r, time.perf_counter() - t0


def published(server, model_dir, tmp_path):
    with engine(tmp_path / "a", model_dir, server.url(password=PW)) as a:
        cold = a.generate_tokens(LONG, max_tokens=4, model="m")
        assert a.flush()["remote_failed"] == []
    return cold


def check_stalled(b, cold):
    r, took = timed(b, LONG)
    assert r.tokens == cold.tokens and r.stats["cache_source"] is None
    assert took < UNMEASURED_DEADLINE_S + r.stats["prefill_s"] + SLACK_S, (took, r.stats["prefill_s"])
    assert b.stats()["remote_deadline_missed"] >= 1
    assert b.cache.remote.tier.breaker.opened_total >= 1  # at the first stall, not after three
    r2, took2 = timed(b, LONG[:2000] + LONG[:1000])  # the breaker open (or one half-open trial): bounded again
    assert took2 < UNMEASURED_DEADLINE_S + r2.stats["prefill_s"] + SLACK_S, (took2, r2.stats["prefill_s"])


def test_a_dripping_server_on_the_first_lookup_costs_at_most_the_capped_deadline(server, tiny_model_dir, tmp_path):
    cold = published(server, tiny_model_dir, tmp_path)
    proxy = DripProxy(server.port)
    try:
        b = engine(tmp_path / "b", tiny_model_dir, f"redis://:{PW}@127.0.0.1:{proxy.port}")
        check_stalled(b, cold)
        b.close()
    finally:
        proxy.close()


def test_a_non_member_pausing_the_server_costs_at_most_the_capped_deadline(server, tiny_model_dir, tmp_path):
    cold = published(server, tiny_model_dir, tmp_path)
    admin = server.client()
    b = engine(tmp_path / "b", tiny_model_dir, server.url(password=PW))
    try:
        admin.client_pause(8000)  # every client waits, ours included
        check_stalled(b, cold)
    finally:
        admin.client_unpause()
        b.close()
