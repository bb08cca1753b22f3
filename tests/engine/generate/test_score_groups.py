"""Scoring many (context, continuation) pairs at once (issue 48, `Engine.score_groups`): each pair's
scores equal `Engine.score` of its context alone; a few-shot block the contexts share is prefilled
once, each question's context once for its choices, the choices of a wave in one forward; a rerun
(and a restart, from SSD) prefills nothing; models that cannot share a prefix score question by
question; bad pairs are clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_archs import build_arch_model

from mlxcache_kernel.engine import Engine, GenerationError
from mlxcache_kernel.engine.generate import score_groups as groups


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


FEW_SHOT = ids(120, 1)  # a task's few-shot block, before every question
QUESTIONS = [ids(9 + i % 4, 100 + i) for i in range(7)]
CHOICES = [[ids(1 + (i + j) % 3, 200 + 10 * i + j) for j in range(2 + i % 3)] for i in range(7)]
OTHER_TASK = [ids(40, 300), ids(40, 301)]  # contexts sharing nothing with the few-shot task


def task_pairs() -> list:
    pairs = [(FEW_SHOT + q, c) for q, cs in zip(QUESTIONS, CHOICES) for c in cs]
    pairs += [(ctx, c) for ctx in OTHER_TASK for c in (ids(2, 400), ids(3, 401))]
    order = np.random.default_rng(0).permutation(len(pairs))  # the harness's order is not the trie's
    return [pairs[i] for i in order]


def alone(eng: Engine, pairs: list) -> list:
    """Each pair scored by `Engine.score` of its context alone, uncached."""
    return [eng.score(ctx, [c], use_cache=False)[0] for ctx, c in pairs]


def assert_same(got: list, want: list) -> None:
    """Tokens and greedy flags equal; log-probabilities to float32 rounding (a random model's logits
    are some 50 in size: test_logprobs_and_scoring.py's `_near`)."""
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.greedy for r in got] == [r.greedy for r in want]
    diff = max(abs(a - b) for r, s in zip(got, want) for a, b in zip(r.token_logprobs, s.token_logprobs))
    assert diff < 2e-3, diff


class Forwards:
    """The model's forward calls, by how many rows and columns each had."""

    def __init__(self, eng: Engine, monkeypatch):
        self.calls: list = []
        model = eng.models.get().model
        original = type(model).__call__

        def counted(this, inputs, *a, **kw):
            if this is model:
                self.calls.append(tuple(inputs.shape))
            return original(this, inputs, *a, **kw)

        monkeypatch.setattr(type(model), "__call__", counted)


@pytest.fixture
def eng(tiny_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as e:
        e.load_model(tiny_model_dir, name="m")
        yield e


def test_each_pair_scores_as_its_context_alone_and_shared_work_is_done_once(eng, monkeypatch):
    pairs = task_pairs()
    want = alone(eng, pairs)
    before = eng.stats()["engine_prefilled_tokens"]
    forwards = Forwards(eng, monkeypatch)
    seen = []
    got = eng.score_groups(pairs, on_progress=lambda *a: seen.append(a))
    assert [r.continuation for r in got] == [c for _, c in pairs]
    assert_same(got, want)
    assert all(abs(r.logprob - sum(r.token_logprobs)) < 1e-9 for r in got)
    # the few-shot block once, each question's own part (but its last token) once, each other
    # task's context (but its last token) once
    own = sum(len(q) - 1 for q in QUESTIONS)
    assert eng.stats()["engine_prefilled_tokens"] - before == len(FEW_SHOT) + own + sum(len(c) - 1 for c in OTHER_TASK)
    assert {r.stats["shared_tokens"] for r in got} == {len(FEW_SHOT), 39}
    # forwards: the block (one chunk), the questions' parts in one left-padded forward of 7 rows, then
    # their 19 choices in one; each other task's context, then its 2 choices
    rows = sum(map(len, CHOICES))
    assert forwards.calls == [(1, 39), (2, 3), (1, 39), (2, 3), (1, 120), (7, max(map(len, QUESTIONS)) - 1),
                              (rows, 3)]
    assert seen[-1] == ("score", len(pairs), len(pairs))


def test_waves_hold_whole_questions_and_every_question_is_scored_once(eng, monkeypatch):
    monkeypatch.setattr(groups, "WAVE_ROWS", 5)
    pairs = [(FEW_SHOT + q, c) for q, cs in zip(QUESTIONS, CHOICES) for c in cs]
    want = alone(eng, pairs)
    forwards = Forwards(eng, monkeypatch)
    got = eng.score_groups(pairs, use_cache=False)
    assert_same(got, want)
    # in the trie's order, waves of whole questions while they hold at most 5 choices: each wave
    # forwards its questions' parts, then its choices
    counts = [len(CHOICES[i]) for i in sorted(range(len(QUESTIONS)), key=lambda i: QUESTIONS[i])]
    want_calls, wave = [], []
    for n in counts + [None]:
        if wave and (n is None or sum(wave) + n > 5):
            want_calls += [len(wave), sum(wave)]
            wave = []
        wave.append(n)
    assert [rows for rows, _ in forwards.calls[1:]] == want_calls and forwards.calls[0] == (1, 120)


def test_a_rerun_and_a_restart_prefill_nothing_and_score_the_same(tiny_model_dir, tmp_path):
    pairs = task_pairs()
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as e:
        e.load_model(tiny_model_dir, name="m")
        first = e.score_groups(pairs)
        before = e.stats()["engine_prefilled_tokens"]
        again = e.score_groups(pairs)
        assert e.stats()["engine_prefilled_tokens"] == before  # every context from RAM
        assert {r.stats["source"] for r in again} == {"ram"}
        assert_same(again, first)
        e.flush()
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as e:  # a kernel restart
        e.load_model(tiny_model_dir, name="m")
        restarted = e.score_groups(pairs)
        assert e.stats()["engine_prefilled_tokens"] == 0
        assert {r.stats["source"] for r in restarted} <= {"ssd", "ram"} and "ssd" in {r.stats["source"] for r in restarted}
        assert_same(restarted, first)


def test_uncached_scoring_publishes_nothing(eng):
    eng.score_groups(task_pairs(), use_cache=False)
    assert eng.admin.entries() == []


def test_strings_are_tokenized_as_score_does(eng):
    block = "Q: Is water wet? A: yes. Q: Is fire cold? A: no. Q: Is ice hot? A: no. " * 2
    pairs = [(block + "Q: Is the sun bright? A:", " yes"), (block + "Q: Is the sun bright? A:", " no"),
             (block + "Q: Is snow black? A: ", "no"), (block + "Q: Is snow black? A: ", "yes")]
    got = eng.score_groups(pairs)
    for r, (ctx, cont) in zip(got, pairs):  # (a trailing space of the context moves to the continuation)
        assert_same([r], eng.score(ctx, [cont], use_cache=False))
        assert r.continuation == cont


def test_quantized_kv_from_a_start_scores_as_score_does(tmp_path):
    from tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "wide", hidden=128)  # head_dim 32
    pairs = [(FEW_SHOT[:n] + q, c) for n in (30, 60) for q, cs in zip(QUESTIONS[:3], CHOICES) for c in cs]
    with Engine(cache_dir=tmp_path / "c", ssd=False) as e:  # the block below the start, and past it
        e.load_model(path, name="q", kv_bits=8, kv_group_size=32, kv_start=40)
        got = e.score_groups(pairs)
        assert {r.stats["mode"] for r in got} == {"grouped"}
        assert_same(got, [e.score(ctx, [c], use_cache=False)[0] for ctx, c in pairs])
        assert_same(e.score_groups(pairs), got)  # from the cache


def test_a_model_that_cannot_share_a_prefix_scores_question_by_question(tmp_path):
    path = build_arch_model("qwen3_next", tmp_path / "m")
    pairs = [(FEW_SHOT[:40] + q, c) for q, cs in zip(QUESTIONS[:3], CHOICES) for c in cs]
    with Engine(cache_dir=tmp_path / "c", ssd=False) as e:
        e.load_model(path)
        got = e.score_groups(pairs)
        assert {r.stats["mode"] for r in got} == {"serial"}
        assert_same(got, [e.score(ctx, [c], use_cache=False)[0] for ctx, c in pairs])


def test_bad_pairs_are_clear_errors(eng):
    with pytest.raises(GenerationError, match="list of"):
        eng.score_groups("context")
    with pytest.raises(GenerationError, match="pair 1 is not a"):
        eng.score_groups([([5, 6], [7]), ([5, 6],)])
    with pytest.raises(GenerationError, match="pair 1 is empty"):
        eng.score_groups([([5, 6], [7]), ([5, 6], [])])
    with pytest.raises(GenerationError, match="pair 0: .*context is empty"):
        eng.score_groups([("", "a")])
    with pytest.raises(GenerationError, match="pair 0: .*token ids"):
        eng.score_groups([([5, 6], "text")])
    # the model attends over the context and the continuation but its last token: 4096 positions fit
    assert len(eng.score_groups([([5] * 4000, [6] * 97)])[0].token_logprobs) == 97
    with pytest.raises(GenerationError, match="pair 0 makes 4098 tokens, 4097 forwarded: past the model's context"):
        eng.score_groups([([5] * 4000, [6] * 98)])
    assert eng.score_groups([]) == []
