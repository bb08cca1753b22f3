"""The numbers a generation reports about itself add up (issue 50)."""

from __future__ import annotations

import pytest

from mlxcache_kernel.engine import Engine

DOC = "The quick brown fox jumps over the lazy dog near the river bank. " * 12


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "cache", ssd=False)
    eng.load_model(tiny_model_dir, name="tiny")
    yield eng
    eng.close()


def test_a_hit_with_a_short_tail_records_the_forward_of_its_tail(engine):
    """A tail of 16-64 tokens goes in one forward with the first token's: that forward is its
    prefill, not the ~0 s of the empty chunked prefill before it (which made the measured rate absurd)."""
    ns = engine.models.get("tiny").namespace
    engine.generate(DOC, max_tokens=2, raw=True)
    cold_rate = engine.metrics.prefill_rate[ns]
    hit = engine.generate(DOC + " Which animal jumps over the dog?",
                          max_tokens=2, raw=True)
    s = hit.stats
    assert s["cache_source"] == "ram" and 16 <= s["prefilled_tokens"] <= 64, s
    to_first_token = s["ttft_s"] - s["lookup_s"]
    assert s["prefill_s"] >= 0.5 * to_first_token, (s["prefill_s"], to_first_token)
    assert s["prefill_tokens_per_s"] == pytest.approx(s["prefilled_tokens"] / s["prefill_s"])
    # the model's measured rate stays a prefill rate (a 2e-7 s prefill made it millions of tokens/s)
    assert engine.metrics.prefill_rate[ns] < 20 * cold_rate, (engine.metrics.prefill_rate[ns], cold_rate)


def test_scoring_records_the_time_of_its_context_prefill(engine):
    before = engine.stats()["engine_prefill_s"]
    engine.score(DOC, [" yes", " no"])
    assert engine.stats()["engine_prefill_s"] > before
