"""Speculative decoding over the remote tier (issue 31): the draft's KV rides the shared Redis/Valkey
tier under its own namespace, like the target's. A second engine on another cache directory (another
machine) with the same remote prefills neither the target's nor the draft's cached tokens, and its
tokens equal plain decoding's."""

from __future__ import annotations

import numpy as np
from remote_fixtures import PW, SECRET, kind, server  # noqa: F401  (fixtures)
from tiny_model import build_tiny_model

from mlxcache_kernel.engine import Engine, SamplingParams

PROMPT = [int(x) for x in np.random.default_rng(1).integers(3, 259, 300)]  # 9 full blocks of 32 below its last
PARAMS = SamplingParams(max_tokens=12, temperature=0.8, seed=4)


def engine(cache_dir, target, draft, url) -> Engine:
    eng = Engine(cache_dir=cache_dir, remote_url=url, remote_secret=SECRET, prefetch_budget_bytes=0)
    eng.load_model(target, name="m")
    eng.load_model(draft, name="small")
    return eng


def test_a_second_machine_prefills_neither_models_cached_tokens(server, tiny_model_dir, tmp_path):
    draft = build_tiny_model(tmp_path / "small", seed=1)
    url = server.url(password=PW)
    with Engine(cache_dir=tmp_path / "plain", ssd=False) as ref:
        ref.load_model(tiny_model_dir, name="m")
        expected = ref.generate_tokens(PROMPT, params=PARAMS, use_cache=False).tokens
    with engine(tmp_path / "a", tiny_model_dir, draft, url) as a:
        cold = a.generate_tokens(PROMPT, params=PARAMS, model="m", draft="small", num_draft_tokens=3)
        assert cold.tokens == expected and cold.stats["draft_prefilled_tokens"] == len(PROMPT)
        report = a.flush()
        assert report["remote_failed"] == [] and a.stats()["remote_blocks_uploaded"] >= 2 * 9  # both models'
    with engine(tmp_path / "b", tiny_model_dir, draft, url) as b:
        hit = b.generate_tokens(PROMPT, params=PARAMS, model="m", draft="small", num_draft_tokens=3)
        s = hit.stats
        assert hit.tokens == expected
        assert s["cache_source"] == "remote" and s["remote_tokens"] == 9 * 32
        assert s["draft_cache_source"] == "remote" and s["draft_cached_tokens"] == 9 * 32
        assert s["prefilled_tokens"] == len(PROMPT) - 9 * 32  # the rest, with the last token
        assert s["draft_prefilled_tokens"] == len(PROMPT) - 9 * 32  # it starts after the first token
        assert b.stats()["remote_hits"] == 2 and b.stats()["remote_kv_mismatch"] == 0
        while b.cache.remote.verifier.busy:  # the idle time between cells recomputes both fetched states
            b.poll()
        assert b.stats()["remote_verified"] == 2
        b.flush()  # verified: kept on this machine's SSD, both models
    with Engine(cache_dir=tmp_path / "b", prefetch_budget_bytes=0) as local:  # no remote now
        local.load_model(tiny_model_dir, name="m")
        local.load_model(draft, name="small")
        again = local.generate_tokens(PROMPT, params=PARAMS, model="m", draft="small", num_draft_tokens=3)
        assert again.tokens == expected
        assert again.stats["cache_source"] == "ssd" and again.stats["draft_cache_source"] == "ssd"
        assert again.stats["draft_prefilled_tokens"] == 0
