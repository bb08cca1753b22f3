"""How sure the model was (issue 29): logprobs of generated tokens, equal to mlx-lm's; scores of
given continuations (lm-eval's loglikelihood), equal to a cold forward of each whole sequence;
batch rows over a shared prefix equal to each row run alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from tiny_archs import build_arch_model

from mlxcache_kernel.engine import Engine, GenerationError, SamplingParams


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


DOC = ids(300, 2)
QUESTIONS = [ids(7 + i, 30 + i) for i in range(4)]


@pytest.fixture(scope="module")
def eng(tiny_model_dir, tmp_path_factory):
    with Engine(cache_dir=tmp_path_factory.mktemp("lp") / "c") as e:
        e.load_model(tiny_model_dir)
        yield e


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return load(str(tiny_model_dir))


def _mlx_lm_logprobs(model, prompt: list, n: int) -> list:
    """mlx-lm's generate_step: (token, its log-probability vector) for n greedy tokens."""
    out = []
    for (token, logprobs), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        out.append((int(token), np.array(logprobs.astype(mx.float32))))
    return out


def test_logprobs_equal_mlx_lms_cold_and_stay_close_after_a_hit(eng, reference):
    model, _ = reference
    prompt = DOC + QUESTIONS[0]
    cold = eng.generate_tokens(prompt, max_tokens=12, logprobs=4, use_cache=False)
    want = _mlx_lm_logprobs(model, prompt, 12)
    assert cold.tokens == [t for t, _ in want] and len(cold.logprobs) == 12
    for lp, (token, vec) in zip(cold.logprobs, want):
        assert lp.token == token and abs(lp.logprob - vec[token]) <= 1e-5
        assert [t for t, _ in lp.top] == list(np.argsort(-vec)[:4]) and all(
            abs(v - vec[t]) <= 1e-5 for t, v in lp.top)
        assert lp.top[0][1] >= lp.logprob and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    eng.generate_tokens(DOC + QUESTIONS[1], max_tokens=2)  # the document cached
    hit = eng.generate_tokens(prompt, max_tokens=12, logprobs=4)
    assert hit.stats["cached_tokens"] >= len(DOC) and hit.tokens == cold.tokens
    assert all(_near(a.logprob, b.logprob) for a, b in zip(hit.logprobs, cold.logprobs))
    assert eng.generate_tokens(prompt, max_tokens=4).logprobs is None  # not asked for


def test_batch_rows_carry_logprobs_and_equal_each_row_alone(eng):
    prompts = [DOC + q for q in QUESTIONS]
    for kw in (dict(max_tokens=10, logprobs=2), dict(max_tokens=10, temperature=0.9, seed=3, logprobs=0)):
        rows = eng.generate_batch(prompts, **kw)
        assert {r.stats["batch_mode"] for r in rows} == {"shared-prefix"}
        for i, (p, r) in enumerate(zip(prompts, rows)):
            alone = eng.generate_tokens(p, **{**kw, "seed": kw.get("seed", 0) + i}, use_cache=False)
            assert r.tokens == alone.tokens, i
            assert len(r.logprobs) == len(r.tokens) and [x.token for x in r.logprobs] == r.tokens
            assert all(_near(a.logprob, b.logprob) for a, b in zip(r.logprobs, alone.logprobs))
            assert all(len(x.top) == kw["logprobs"] for x in r.logprobs)


def test_bad_logprobs_are_clear_errors(eng):
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(GenerationError, match="logprobs must be an integer from 0 to 20"):
            eng.generate_tokens(DOC, max_tokens=2, logprobs=bad)
    with pytest.raises(GenerationError, match="checkpoint_every or logprobs"):
        eng.generate_tokens(DOC, max_tokens=2, logprobs=1, checkpoint_every=4)


# --- scoring ---------------------------------------------------------------------


def _cold_token_logprobs(model, tok, context: str, continuation: str) -> list:
    """lm-eval's loglikelihood, token by token, by one full forward of the whole sequence."""
    ctx = tok.encode(context)
    whole = tok.encode(context + continuation)
    lp = model(mx.array(whole)[None])[0].astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    return [float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(whole[len(ctx):])]


def _near(a: float, b: float) -> bool:
    """Equal to float32 rounding. A random model's logits are some 50 in size, and a forward over
    other rows (a batch, another chunk) sums them in another order: 1e-5 of that moves every
    logprob, more after each decode step (mlx 0.32.4: up to 5.2e-4 within ten batch steps, 2.5e-4
    on scores near -50). Tokens and top lists are compared exactly."""
    return abs(a - b) <= 1e-3 + 1e-5 * abs(b)


def _close(result, want: list) -> bool:
    """Each token to float32 rounding (`_near`); a sum of twenty carries twenty roundings, so the
    sum is compared relative to its size."""
    return (len(result.token_logprobs) == len(want)
            and all(_near(a, b) for a, b in zip(result.token_logprobs, want))
            and abs(result.logprob - sum(want)) <= 1e-5 * abs(sum(want)) + 1e-4)


def test_scores_equal_a_cold_forward_of_each_sequence_and_the_context_is_cached_once(eng, reference):
    model, tok = reference
    context = "The keeper climbed the stairs of the lighthouse every evening at dusk. " * 6 + "He carried a"
    options = [" lamp", " lantern full of oil", " book", " small brass key for the door"]
    first = eng.score(context, options)
    assert [r.continuation for r in first] == options and first[0].stats["mode"] == "batched"
    for r, o in zip(first, options):
        assert _close(r, _cold_token_logprobs(model, tok, context, o))
        assert len(r.token_logprobs) == len(r.tokens) and abs(sum(r.token_logprobs) - r.logprob) < 1e-9
    again = eng.score(context, options)  # the context from the cache now
    assert again[0].stats["cached_tokens"] == len(tok.encode(context)) - 1
    assert all(_close(a, b.token_logprobs) for a, b in zip(again, first))
    # lm-eval's whitespace rule: a trailing space of the context belongs to the continuation
    assert _close(eng.score(context + " ", ["lamp"])[0], first[0].token_logprobs)
    # the greedy continuation is flagged greedy, another is not
    greedy = eng.generate_tokens(tok.encode(context), max_tokens=5, use_cache=False).tokens
    ranked = eng.score(tok.encode(context), [greedy, greedy[:2] + [(greedy[2] + 1) % 200 + 3]])
    assert ranked[0].greedy and not ranked[1].greedy and ranked[0].tokens == greedy


def test_a_model_that_cannot_share_a_prefix_scores_each_continuation_exactly(tmp_path):
    path = build_arch_model("qwen3_next", tmp_path / "m")
    model, tok = load(str(path))
    with Engine(cache_dir=tmp_path / "c") as e:
        e.load_model(path)
        context = "A recurrent model reads the context once. " * 4 + "Then"
        rs = e.score(context, [" it ends", " more text follows here"])
        assert rs[0].stats["mode"] == "serial"
        for r, o in zip(rs, [" it ends", " more text follows here"]):
            assert _close(r, _cold_token_logprobs(model, tok, context, o))


def test_bad_score_input_is_a_clear_error(eng):
    with pytest.raises(GenerationError, match="continuation 1 is empty"):
        eng.score([5, 6, 7], [[8], []])
    with pytest.raises(GenerationError, match="context is empty"):
        eng.score("", ["a"])
    with pytest.raises(GenerationError, match="non-empty list"):
        eng.score("context", "not a list")
    with pytest.raises(GenerationError, match="past the model's context window of 4096"):
        eng.score([5] * 4000, [[6] * 200])
    with pytest.raises(GenerationError, match="token ids"):
        eng.score([5, 6], ["text"])
