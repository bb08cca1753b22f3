"""Engine behaviour on a tiny random model (and SmolLM2 where text matters)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcache_kernel.engine import Engine, GenerationError, ModelError, SessionError
from mlxcache_kernel.engine.kv.checkpoint import Checkpoint

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Numbers: 3.14159 2.71828 1.41421 and a tab\there.",
    "Short one.",
]


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "cache", ssd=False)
    eng.load_model(tiny_model_dir, name="tiny")
    yield eng
    eng.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_ram_hit_continues_exactly_like_a_cold_run(engine, prompt):
    cold = engine.generate(prompt, max_tokens=24, use_cache=False)
    first = engine.generate(prompt, max_tokens=24)
    hit = engine.generate(prompt, max_tokens=24)
    assert first.stats["cache_source"] is None
    assert hit.stats["cache_source"] == "ram"
    assert hit.stats["cached_tokens"] == hit.stats["prompt_tokens"] - 1
    assert cold.tokens == first.tokens == hit.tokens
    assert cold.text == hit.text


def test_hit_logits_match_cold_prefill(engine):
    m = engine.models.get()
    tokens = engine.encode_prompt(PROMPTS[0])
    engine.generate(PROMPTS[0], max_tokens=4)
    lease = engine.cache.take(tokens, m.namespace)
    assert lease is not None and lease.length == len(tokens) - 1
    warm = m.model(mx.array(tokens[lease.length :])[None], cache=lease.caches)[:, -1, :]
    cold = m.model(mx.array(tokens)[None], cache=make_prompt_cache(m.model))[:, -1, :]
    np.testing.assert_allclose(np.array(warm), np.array(cold), rtol=1e-4, atol=1e-4)
    lease.release()


def test_longer_prompt_reuses_the_prompt_boundary(engine):
    engine.generate(PROMPTS[0], max_tokens=8)
    base = engine.encode_prompt(PROMPTS[0])
    r = engine.generate(PROMPTS[0], max_tokens=8, raw=True)  # another rendering: no shared chat prefix beyond text
    assert r.stats["prompt_tokens"] != len(base)
    # A chat session: turn 2 renders turn 1's prompt + reply + new user text.
    t1 = engine.generate("Tell me a story.", max_tokens=12, session="s")
    t2 = engine.generate("And another.", max_tokens=12, session="s")
    assert t2.stats["cache_source"] == "ram"
    assert t2.stats["cached_tokens"] >= t1.stats["prompt_tokens"]
    assert engine.sessions.get("s").turns == 2


def test_seeded_sampling_is_reproducible_with_and_without_cache(engine):
    kw = dict(max_tokens=16, temperature=0.9, top_p=0.95, top_k=40, seed=7)
    a = engine.generate(PROMPTS[1], use_cache=False, **kw)
    b = engine.generate(PROMPTS[1], **kw)
    c = engine.generate(PROMPTS[1], **kw)
    assert a.tokens == b.tokens == c.tokens
    assert c.stats["cache_source"] == "ram"
    other = engine.generate(PROMPTS[1], use_cache=False, **{**kw, "seed": 8})
    assert other.tokens != a.tokens


def test_stop_string_truncates_text(engine):
    full = engine.generate(PROMPTS[0], max_tokens=24, use_cache=False)
    visible = [ch for ch in full.text[3:] if ch.isprintable() and not ch.isspace()]
    if not visible:
        pytest.skip("tiny model produced no printable text to stop on")
    stop = visible[0]
    cut = full.text.index(stop)
    r = engine.generate(PROMPTS[0], max_tokens=24, stop=[stop], use_cache=False)
    assert r.text == full.text[:cut]
    assert r.stats["finish_reason"] == "stop"


def test_streaming_callback_concatenates_to_text(engine):
    pieces = []
    r = engine.generate(PROMPTS[2], max_tokens=20, on_text=pieces.append)
    assert "".join(pieces) == r.text


def test_bad_input_is_a_clear_error_and_keeps_the_cache(engine, tmp_path):
    engine.generate(PROMPTS[0], max_tokens=4)
    entries = len(engine.admin.entries())
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    cases = [
        (ModelError, "does not exist", lambda: engine.load_model(tmp_path / "missing")),
        (ModelError, "no config.json", lambda: engine.load_model(not_a_model)),
        (ModelError, "unknown model 'nope'", lambda: engine.generate("hi", model="nope")),
        (GenerationError, "empty prompt", lambda: engine.generate("   ")),
        (GenerationError, "max_tokens", lambda: engine.generate("hi", max_tokens=0)),
        (GenerationError, "temperature", lambda: engine.generate("hi", temperature=-0.5)),
        (GenerationError, "top_p", lambda: engine.generate("hi", top_p=0)),
        (SessionError, "invalid session id", lambda: engine.generate("hi", session="../etc")),
    ]
    for exc, words, call in cases:
        with pytest.raises(exc, match=words):
            call()
    assert len(engine.admin.entries()) == entries
    assert engine.generate(PROMPTS[0], max_tokens=4).stats["cache_source"] == "ram"


def test_ram_budget_evicts_lru_and_accounts_bytes(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False, ram_budget_bytes=400_000)
    eng.load_model(tiny_model_dir)
    for i in range(6):
        eng.generate(f"Document number {i}: " + "lorem ipsum " * 8, max_tokens=4)
    s = eng.stats()
    assert s["evictions"] > 0
    assert s["ram_used_bytes"] <= 400_000
    assert s["ram_used_bytes"] == sum(r["ram_bytes"] for r in eng.admin.entries())
    eng.close()


def test_model_identity_memo_and_namespace(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    a = eng.load_model(tiny_model_dir, name="a")
    b = eng.load_model(tiny_model_dir, name="b")
    assert a["namespace"] == b["namespace"]
    assert (tmp_path / "c" / "identities.json").exists()
    assert oct(os.stat(tmp_path / "c").st_mode & 0o777) == "0o700"
    eng.models.unload("a")
    assert eng.models.names() == ["b"]


def test_capture_rejects_mismatched_length(engine):
    m = engine.models.get()
    caches = make_prompt_cache(m.model)
    m.model(mx.array([[1, 2, 3]]), cache=caches)
    with pytest.raises(ValueError, match="3 positions"):
        Checkpoint.capture([1, 2], caches)


@pytest.mark.smollm
def test_smollm_hit_equals_cold(default_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(default_model_dir)
    prompt = "List three facts about the planet Mars."
    cold = eng.generate(prompt, max_tokens=24, use_cache=False)
    eng.generate(prompt, max_tokens=24)
    hit = eng.generate(prompt, max_tokens=24)
    assert hit.stats["cache_source"] == "ram"
    assert hit.tokens == cold.tokens
    eng.close()


def _interrupt_after(n):
    calls = []

    def callback(*args):
        calls.append(args)
        if len(calls) == n:
            raise KeyboardInterrupt

    return callback


def test_interrupted_decode_keeps_the_prompt_and_what_was_generated(engine):
    cold = engine.generate(PROMPTS[0], max_tokens=24, use_cache=False)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(PROMPTS[0], max_tokens=24, on_text=_interrupt_after(5))
    again = engine.generate(PROMPTS[0], max_tokens=24)
    assert again.stats["cache_source"] == "ram"
    assert again.stats["cached_tokens"] == again.stats["prompt_tokens"] - 1
    assert again.tokens == cold.tokens


def test_interrupted_prefill_keeps_the_chunks_done(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False, prefill_chunk=16)
    eng.load_model(tiny_model_dir)
    prompt = "A long document to prefill in small chunks. " * 6
    cold = eng.generate(prompt, max_tokens=8, use_cache=False)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(prompt, max_tokens=8, on_progress=_interrupt_after(4))  # after 3 chunks (and the report before them)
    again = eng.generate(prompt, max_tokens=8)
    assert again.stats["cache_source"] == "ram" and again.stats["cached_tokens"] == 48
    assert again.tokens == cold.tokens
    eng.close()


def test_a_borrower_that_supersedes_its_donor_takes_over_its_buffers(engine):
    prompt = "A long prompt the same cell reruns. " * 8
    cold = engine.generate(prompt, max_tokens=8, use_cache=False)
    engine.generate(prompt, max_tokens=8)
    before = engine.stats()["handovers"]
    hit = engine.generate(prompt, max_tokens=8)  # uses > 75% of the entry: its buffers move, no prefix copy
    assert engine.stats()["handovers"] == before + 1
    assert hit.stats["cache_source"] == "ram" and hit.tokens == cold.tokens
    assert engine.generate(prompt, max_tokens=8).tokens == cold.tokens  # republished by the borrower
    # A short shared prefix (the chat template) never moves a donor away.
    handovers = engine.stats()["handovers"]
    other = engine.generate("Something else entirely.", max_tokens=4)
    assert other.stats["cache_source"] == "ram" and engine.stats()["handovers"] == handovers
    assert engine.cache.get_exact(tuple(engine.encode_prompt(prompt) + hit.tokens[:7]), engine.models.get().namespace)


def test_questions_about_one_document_do_not_move_each_others_state(engine):
    doc = "A shared document about tides and harbors. " * 6
    a = engine.generate(doc + "Question A?", max_tokens=6)
    handovers = engine.stats()["handovers"]
    b = engine.generate(doc + "Question B?", max_tokens=6)
    assert b.stats["cache_source"] == "ram" and b.stats["cached_tokens"] > 200
    assert engine.stats()["handovers"] == handovers
    ns = engine.models.get().namespace
    a_tokens = engine.encode_prompt(doc + "Question A?") + a.tokens[:5]
    assert engine.cache.get_exact(a_tokens, ns) is not None, "question A's state stays in RAM"


def test_stats_follow_the_one_schema(tiny_model_dir, tmp_path):
    from mlxcache_kernel.engine.metrics import SCHEMA

    with Engine(cache_dir=tmp_path / "ssd") as eng:
        eng.load_model(tiny_model_dir)
        eng.generate(PROMPTS[0], max_tokens=4)
        eng.flush()
        s = eng.stats()
        assert set(s) == set(SCHEMA)
        assert s["ram_kv_bytes"] <= s["ram_used_bytes"] and 0 < s["ssd_kv_bytes"] <= s["ssd_bytes"]
    with Engine(cache_dir=tmp_path / "ram", ssd=False) as eng:
        assert set(eng.stats()) <= set(SCHEMA)


# --- the numbers a generation reports about itself add up (issue 50) ---

DOC = "The quick brown fox jumps over the lazy dog near the river bank. " * 12


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
