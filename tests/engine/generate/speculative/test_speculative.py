"""Speculative decoding over the cache (engine/generate/speculative/draft.py): the tokens equal plain
decoding's, greedy and seeded, cold, from RAM and from SSD in a new process; the draft's own KV comes from the cache too;
caches that cannot roll back fall back to plain decoding with a notice; bad drafts are clear errors.

Tiny random llama models: the draft is the target itself (every proposal accepted) or another seed
(few accepted). A KV quantization converting during the generation takes the fallback; every other
cache kind rolls back exactly (test_speculative_kinds.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from tiny_model import SPECIALS, build_tiny_model, save_byte_level_tokenizer

from mlxcache_kernel.engine import Engine, GenerationError
from mlxcache_kernel.engine.models.registry import ModelError
from repo_paths import SUPPORT

DOC = "A long shared document about harbours, ships and the weather near the coast. " * 2
MODES = {"greedy": dict(max_tokens=24), "seeded": dict(max_tokens=24, temperature=0.8, seed=5, top_p=0.95)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {"target": build_tiny_model(root / "target", seed=0), "other": build_tiny_model(root / "other", seed=1)}


def plain(dirs, tmp_path, prompt, **sampling):
    with Engine(cache_dir=tmp_path / "plain", ssd=False) as eng:
        eng.load_model(dirs["target"], name="m")
        return eng.generate(prompt, use_cache=False, **sampling)


def load(eng, dirs):
    eng.load_model(dirs["target"], name="m")
    eng.load_model(dirs["other"], name="small")
    eng.load_model(dirs["target"], name="twin")  # the target's own weights under another name


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("draft", ["m", "twin", "small"])
def test_tokens_equal_plain_decoding_cold_and_from_ram(draft, mode, dirs, tmp_path):
    sampling = MODES[mode]
    prompt = DOC + "What is the weather like?"
    expected = plain(dirs, tmp_path, prompt, **sampling)
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        load(eng, dirs)
        for k in (1, 3, 5):
            eng.flush(timeout=60)  # no write of the previous k lands after the clear
            eng.cache_clear(ssd=True)
            cold = eng.generate(prompt, model="m", draft=draft, num_draft_tokens=k, **sampling)
            rerun = eng.generate(prompt, model="m", draft=draft, num_draft_tokens=k, **sampling)
            for r in (cold, rerun):
                assert r.tokens == expected.tokens and r.text == expected.text, (draft, mode, k)
                s = r.stats
                assert s["draft"] == draft and s["num_draft_tokens"] == k and s["draft_fallback"] is None
                assert s["draft_tokens_proposed"] > 0 and 0 <= s["draft_tokens_accepted"] <= s["draft_tokens_proposed"]
                assert s["draft_acceptance"] == round(s["draft_tokens_accepted"] / s["draft_tokens_proposed"], 4)
                if draft != "small":  # the target's own model proposes what the target samples
                    assert s["draft_tokens_accepted"] == s["draft_tokens_proposed"]
            n = len(rerun.prompt_tokens) - 1
            # the draft starts at its first proposal, after the first token: it holds the whole prompt
            assert cold.stats["cached_tokens"] == 0 and cold.stats["draft_prefilled_tokens"] == n + 1
            assert rerun.stats["cache_source"] == "ram" and rerun.stats["cached_tokens"] == n
            assert rerun.stats["draft_prefilled_tokens"] == 0 and rerun.stats["draft_cache_source"] == "ram"
            assert rerun.stats["draft_cached_tokens"] == n + 1
        # the target's KV is the one plain generation of the model uses (and the other way round)
        again = eng.generate(prompt, model="m", **sampling)
        assert again.tokens == expected.tokens and again.stats["cached_tokens"] == n


def test_a_second_question_over_a_cached_document_prefills_neither_models_document(dirs, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        load(eng, dirs)
        first = eng.generate(DOC + "Ships?", model="m", draft="small", max_tokens=8)
        doc_tokens = len(eng.encode_prompt(DOC, model="m", raw=True))
        second = eng.generate(DOC + "And the weather?", model="m", draft="small", max_tokens=8)
        assert second.tokens == plain(dirs, tmp_path, DOC + "And the weather?", max_tokens=8).tokens
        assert first.stats["draft_prefilled_tokens"] == len(first.prompt_tokens)
        assert second.stats["cached_tokens"] >= doc_tokens and second.stats["draft_cached_tokens"] >= doc_tokens
        assert second.stats["draft_prefilled_tokens"] == len(second.prompt_tokens) - second.stats["draft_cached_tokens"]


WORKER = """
import json, sys
sys.path.insert(0, {support!r})
from mlxcache_kernel.engine import Engine
out = {{}}
with Engine(cache_dir={cache!r}, prefetch_budget_bytes=0) as eng:
    eng.load_model({target!r}, name="m")
    eng.load_model({other!r}, name="small")
    for mode, sampling in {modes!r}.items():
        r = eng.generate({prompt!r}, model="m", draft="small", num_draft_tokens=3, **sampling)
        out[mode] = [r.tokens, {{k: r.stats[k] for k in ("cache_source", "cached_tokens", "draft_cache_source",
                                                       "draft_cached_tokens", "draft_prefilled_tokens")}}]
print(json.dumps(out))
"""


def test_both_models_state_from_ssd_in_a_new_process(dirs, tmp_path):
    prompt = DOC + "Tell me more."
    expected = {mode: plain(dirs, tmp_path, prompt, **s).tokens for mode, s in MODES.items()}
    cache = tmp_path / "c"
    with Engine(cache_dir=cache, prefetch_budget_bytes=0) as eng:
        load(eng, dirs)
        for mode, sampling in MODES.items():
            r = eng.generate(prompt, model="m", draft="small", num_draft_tokens=3, **sampling)
            assert r.tokens == expected[mode]
        assert eng.flush(timeout=60)["pending"] == 0
    script = WORKER.format(support=str(SUPPORT), cache=str(cache), target=str(dirs["target"]),
                           other=str(dirs["other"]), modes=MODES, prompt=prompt)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for mode, (tokens, stats) in out.items():
        assert tokens == expected[mode], mode
        n = stats["cached_tokens"]
        assert n > 0 and stats["draft_cached_tokens"] == n + 1 and stats["draft_prefilled_tokens"] == 0, stats
    assert out["greedy"][1]["cache_source"] == "ssd" and out["greedy"][1]["draft_cache_source"] == "ssd"


def test_stop_strings_eos_logprobs_and_the_last_token(dirs, tmp_path):
    prompt = "Hello there, how are you?"
    base = plain(dirs, tmp_path, prompt, max_tokens=30, logprobs=2)
    stop = base.text[3:6]
    assert len(stop) == 3 and base.stats["finish_reason"] == "length"
    short = plain(dirs, tmp_path, "Count with me:", max_tokens=30)
    assert short.stats["finish_reason"] == "eos" and len(short.tokens) < 30  # this model's eos comes early here
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        load(eng, dirs)
        for draft in ("m", "small"):
            r = eng.generate(prompt, model="m", draft=draft, num_draft_tokens=4, max_tokens=30, logprobs=2)
            assert r.tokens == base.tokens
            for a, b in zip(r.logprobs, base.logprobs):
                # 1e-3: the verify forward over K + 1 positions sums in another order than one position
                assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-3
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
            stopped = eng.generate(prompt, model="m", draft=draft, num_draft_tokens=4, max_tokens=30, stop=stop)
            assert stopped.text == plain(dirs, tmp_path, prompt, max_tokens=30, stop=stop).text
            assert stopped.stats["finish_reason"] == "stop"
            one = eng.generate(prompt, model="m", draft=draft, num_draft_tokens=4, max_tokens=1)
            assert one.tokens == base.tokens[:1]
            # the first token comes before the draft runs at all (TTFT as without a draft)
            assert one.stats["draft_tokens_proposed"] == 0 and one.stats["draft_prefilled_tokens"] == 0
            eos = eng.generate("Count with me:", model="m", draft=draft, num_draft_tokens=4, max_tokens=30)
            assert eos.tokens == short.tokens and eos.stats["finish_reason"] == "eos"
            assert eng.generate("Count with me:", model="m", max_tokens=30).tokens == short.tokens  # its state


def test_a_kv_quantization_converting_during_the_generation_falls_back_with_a_notice(tmp_path):
    path = build_tiny_model(tmp_path / "q", seed=0, hidden=128)  # head_dim 32: KV quantizable in groups of 32
    prompt = "Harbours and ships."  # shorter than kv_start; prompt + 24 tokens cross it
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(path, name="q", kv_bits=8, kv_group_size=32, kv_start=40)
        eng.load_model(path, name="q2", kv_bits=8, kv_group_size=32, kv_start=40)
        assert len(eng.encode_prompt(prompt, model="q")) < 40
        for sampling in MODES.values():
            expected = eng.generate(prompt, model="q", use_cache=False, **sampling)
            seen = len(eng.events.recent)
            r = eng.generate(prompt, model="q", draft="q2", **sampling)
            assert r.tokens == expected.tokens
            notices = [e for e in list(eng.events.recent)[seen:] if e["type"] == "notice"]
            assert len(notices) == 1 and "converts its KV to 8 bits at token 40" in notices[0]["message"]
            assert "without the draft" in notices[0]["message"]
            assert r.stats["draft_fallback"] == notices[0]["message"] and r.stats["draft_tokens_proposed"] == 0


def test_bad_drafts_are_clear_errors(dirs, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(dirs["other"], odd)
    save_byte_level_tokenizer(odd, SPECIALS + ["<|extra|>"])  # another tokenizer, same weights
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        load(eng, dirs)
        eng.load_model(odd, name="odd")
        with pytest.raises(ModelError, match="unknown draft model 'nope'.*loaded: m, odd, small, twin"):
            eng.generate("hi", model="m", draft="nope")
        with pytest.raises(GenerationError, match="'odd' has another tokenizer than 'm'"):
            eng.generate("hi", model="m", draft="odd")
        for bad in (0, 33, "3", True):
            with pytest.raises(GenerationError, match="num_draft_tokens must be an integer from 1 to 32"):
                eng.generate("hi", model="m", draft="small", num_draft_tokens=bad)
        with pytest.raises(GenerationError, match="num_draft_tokens needs a draft"):
            eng.generate("hi", model="m", num_draft_tokens=3)
        assert eng.generate("hi", model="m", draft="small", max_tokens=3).stats["draft"] == "small"


def test_a_vision_language_draft_is_a_clear_error(dirs, tmp_path):
    pytest.importorskip("mlx_vlm")
    from tiny_vlm import build_vlm

    vlm = build_vlm("qwen2_vl", tmp_path / "vlm")
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(dirs["target"], name="m")
        eng.load_model(vlm, name="v")
        with pytest.raises(GenerationError, match="draft model 'v' is a vision-language model"):
            eng.generate("hi", model="m", draft="v")


def test_a_default_draft_per_model(dirs, tmp_path):
    prompt = DOC + "Where are the ships?"
    expected = plain(dirs, tmp_path, prompt, max_tokens=12)
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(dirs["other"], name="small")
        with pytest.raises(ModelError, match="unknown draft model 'nope': load it before the model it drafts for"):
            eng.load_model(dirs["target"], name="m", draft="nope")
        assert "m" not in eng.models
        info = eng.load_model(dirs["target"], name="m", draft="small")
        assert info["draft"] == "small"
        r = eng.generate(prompt, model="m", max_tokens=12)  # no draft= : the default one
        assert r.tokens == expected.tokens and r.stats["draft"] == "small" and r.stats["num_draft_tokens"] == 4
        assert r.stats["draft_tokens_proposed"] > 0
        k = eng.generate(prompt, model="m", max_tokens=12, num_draft_tokens=2)
        assert k.tokens == expected.tokens and k.stats["draft"] == "small" and k.stats["num_draft_tokens"] == 2
        off = eng.generate(prompt, model="m", max_tokens=12, draft=False)
        assert off.tokens == expected.tokens and "draft" not in off.stats
        assert eng.generate(prompt, model="small", max_tokens=4).stats.get("draft") is None  # its own, none
        eng.models.unload("small")
        with pytest.raises(ModelError, match="model 'm''s default draft 'small' is not loaded.*draft=False"):
            eng.generate(prompt, model="m", max_tokens=4)
        assert eng.generate(prompt, model="m", max_tokens=12, draft=False).tokens == expected.tokens
        odd = tmp_path / "odd"
        shutil.copytree(dirs["other"], odd)
        save_byte_level_tokenizer(odd, SPECIALS + ["<|extra|>"])
        eng.load_model(odd, name="odd")
        with pytest.raises(ModelError, match="model 'm2' not loaded: draft model 'odd' has another tokenizer"):
            eng.load_model(dirs["target"], name="m2", draft="odd")
        assert "m2" not in eng.models
        with pytest.raises(ModelError, match="model 'm' not loaded: draft model 'odd' has another tokenizer"):
            eng.load_model(dirs["target"], name="m", draft="odd")  # refused before it replaces the loaded 'm'
        assert eng.generate(prompt, model="m", max_tokens=12, draft=False).tokens == expected.tokens
