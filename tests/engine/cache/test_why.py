"""Why a prompt reused less than it could (engine/cache/why.py, `eng.admin.why()`, the footer's line):
each cause named, on tiny random models of real architectures (issue 50)."""

from __future__ import annotations

import pytest

from mlxcache_kernel.engine import Engine

DOC = ("The harbour master keeps a ledger of every ship: its name, its cargo, the day it came in and the day "
       "it left. On stormy nights the lighthouse keeper writes the weather beside each entry. ")


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A tiny llama with head_dim 32 (8-bit KV in groups of 32 fits it)."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "wide", hidden=128)


@pytest.fixture
def eng(wide_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as e:
        e.load_model(wide_model_dir, name="m")
        yield e


def cause(r) -> tuple:
    return r.stats["cache_why_cause"], r.stats["cache_why"]


def test_another_system_prompt(eng):
    eng.generate(DOC + "Who keeps the ledger?", system="You are a harbour clerk.", max_tokens=3)
    r = eng.generate(DOC + "Who keeps the ledger?", system="Answer in one word.", max_tokens=3)
    assert cause(r)[0] == "system_prompt" and "another system prompt" in cause(r)[1]
    why = eng.admin.why()
    assert why.cause == "system_prompt" and why.could > why.reused + 100
    text = str(why)
    assert "they part at token" in text and "this prompt:" in text and "cached:" in text
    assert "Answer in" in text and "You are a" in text  # the text on both sides of where they part


def test_another_template(eng):
    eng.generate(DOC + "Who keeps the ledger?", max_tokens=3)  # the chat template
    r = eng.generate(DOC + "Who keeps the ledger?", raw=True, max_tokens=3)  # the same text, no template
    assert cause(r)[0] == "template" and "template" in cause(r)[1]


def test_a_date_in_the_template(eng):
    eng.generate("Today Date: 26 Jul 2024\n\n" + DOC, raw=True, max_tokens=3)
    r = eng.generate("Today Date: 27 Jul 2024\n\n" + DOC, raw=True, max_tokens=3)
    assert cause(r)[0] == "date" and "date" in cause(r)[1]


def test_another_kv_setting(wide_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(wide_model_dir, name="full")
        eng.load_model(wide_model_dir, name="q8", kv_bits=8, kv_group_size=32, kv_start=0)
        eng.generate(DOC, model="full", max_tokens=3)
        r = eng.generate(DOC, model="q8", max_tokens=3)
        assert cause(r)[0] == "other_model", cause(r)
        assert "model full" in cause(r)[1] and "full-precision KV there, 8-bit KV (groups of 32) here" in cause(r)[1]


def test_an_entry_never_written_to_ssd(wide_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", ssd=False, ram_budget_bytes=1) as eng:  # every entry evicted at once
        eng.load_model(wide_model_dir, name="m")
        eng.generate(DOC, max_tokens=3)
        r = eng.generate(DOC + "Who keeps the ledger?", max_tokens=3)
        assert cause(r)[0] == "not_written" and "no SSD tier" in cause(r)[1], cause(r)


def test_an_evicted_entry(eng):
    eng.generate(DOC, max_tokens=3)
    eng.flush()
    eng.admin.clear(ssd=True)
    r = eng.generate(DOC + "Who keeps the ledger?", max_tokens=3)
    assert cause(r)[0] == "evicted" and "SSD file was removed" in cause(r)[1], cause(r)


def test_a_state_that_cannot_be_cut_back(tmp_path):
    from tiny_archs import build_arch_model

    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(build_arch_model("mamba2", tmp_path / "mamba2"), name="r")
        eng.generate(DOC + "Who keeps the ledger?", raw=True, max_tokens=3)
        r = eng.generate(DOC + "When did the ships leave?", raw=True, max_tokens=3)
        assert cause(r)[0] == "uncuttable" and "cannot be cut back" in cause(r)[1], cause(r)


def test_a_new_question_is_no_surprise(eng):
    eng.generate(DOC + "Who keeps the ledger?", max_tokens=3)
    r = eng.generate(DOC + "What does the keeper write?", max_tokens=3)
    assert r.stats["cache_source"] == "ram" and cause(r) == ("diverged", None)  # the footer says nothing
    assert eng.admin.why().cause == "diverged"
    assert eng.admin.why(DOC + "What does the keeper write?").cause == "hit"  # asked again now: all of it is cached
