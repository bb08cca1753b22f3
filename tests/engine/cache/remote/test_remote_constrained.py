"""A constrained answer after a team-tier hit (issue 45): a second engine on another cache directory (another
machine) with the same Redis/Valkey server takes the prompt's blocks from the remote tier and answers
under the same JSON Schema exactly as a cold run does, with drafts from a twin too."""

from __future__ import annotations

import numpy as np
from remote_fixtures import PW, SECRET, kind, server  # noqa: F401  (fixtures)

from mlxcache_kernel.engine import Engine

PROMPT = [int(x) for x in np.random.default_rng(2).integers(3, 259, 300)]  # 9 full blocks of 32 below its last
SCHEMA = {"type": "object", "x-guidance": {"whitespace_flexible": False}, "additionalProperties": False,
          "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "maximum": 999}},
          "required": ["word", "n"]}
OPTIONS = dict(max_tokens=80, temperature=0.8, seed=3, response_format=SCHEMA)


def test_a_second_machine_answers_under_the_schema_as_a_cold_run(server, tiny_model_dir, tmp_path):
    url = server.url(password=PW)
    with Engine(cache_dir=tmp_path / "plain", ssd=False) as ref:
        ref.load_model(tiny_model_dir, name="m")
        cold = ref.generate_tokens(PROMPT, use_cache=False, **OPTIONS)
        assert cold.parsed is not None and cold.stats["finish_reason"] == "eos"
    with Engine(cache_dir=tmp_path / "a", remote_url=url, remote_secret=SECRET, prefetch_budget_bytes=0) as a:
        a.load_model(tiny_model_dir, name="m")
        assert a.generate_tokens(PROMPT, **OPTIONS).tokens == cold.tokens
        assert a.flush()["remote_failed"] == []
    with Engine(cache_dir=tmp_path / "b", remote_url=url, remote_secret=SECRET, prefetch_budget_bytes=0) as b:
        b.load_model(tiny_model_dir, name="m")
        b.load_model(tiny_model_dir, name="twin")
        hit = b.generate_tokens(PROMPT, **OPTIONS)
        assert hit.stats["cache_source"] == "remote" and hit.stats["remote_tokens"] == 9 * 32
        assert hit.tokens == cold.tokens and hit.parsed == cold.parsed
        drafted = b.generate_tokens(PROMPT, draft="twin", **OPTIONS)
        assert drafted.tokens == cold.tokens and drafted.stats["draft_acceptance"] == 1.0
