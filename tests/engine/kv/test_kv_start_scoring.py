"""Scored continuations of a model with a delayed KV quantization (kv_bits with kv_start) go in one
batched forward over the shared context, each row converting at exactly kv_start at its own column
(kv/cascade_quantized.py); the scores equal scoring each continuation alone (the serial path, which
a model that cannot be routed through the rows cache takes), within float32 rounding."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.generate import scoring

START = 40


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


DOC = ids(90, 11)
# after a context of 30 (29 cached, its last token first in every row) rows reach 40 at different
# columns of the left-padded batch: never (4), exactly at their end (11), at their last position
# (12), inside (20, 15)
CONTS = [ids(n, s) for s, n in enumerate([4, 11, 12, 20, 15])]


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "wide", hidden=128)  # head_dim 32


def engine(tmp_path, model_dir, name: str, *, chunk: int = 512, start: int = START) -> Engine:
    eng = Engine(cache_dir=tmp_path / name, prefill_chunk=chunk, ssd=False)
    eng.load_model(model_dir, name="q", kv_bits=8, kv_group_size=32, kv_start=start)
    return eng


@contextmanager
def _unroutable(model, attend=None):
    yield False  # as for a model none of whose modules attends through mlx-lm's attention


def serial(eng: Engine, context, conts, monkeypatch, **kw) -> list:
    """The scores of each continuation alone (the fallback of a model the rows cache cannot route)."""
    with monkeypatch.context() as m:
        m.setattr(scoring, "routing", _unroutable)
        rs = eng.score(context, conts, **kw)
    assert {r.stats["mode"] for r in rs} == {"serial"}
    return rs


def assert_same(got: list, want: list) -> None:
    """Greedy flags equal; log-probabilities to float32 rounding. Measured on this model, batched
    against serial: up to 1.3e-3 (chunks of 4; 6e-4 in one chunk), as much as with float32 KV
    (1.2e-3); a forward not split at a row's conversion column moves them by 3.7."""
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.greedy for r in got] == [r.greedy for r in want]
    diff = max(abs(a - b) for r, s in zip(got, want) for a, b in zip(r.token_logprobs, s.token_logprobs))
    assert diff < 2e-3, diff


def entry(eng: Engine, tokens: list):
    e = eng.cache.get_exact(tokens, eng.models.get("q").namespace)
    return e.checkpoint if e is not None else None


@pytest.mark.parametrize("chunk", [512, 4])  # (4: rows reach the start inside chunks and at their ends)
def test_a_context_below_the_start_batches_and_each_row_converts_at_its_own_column(
        wide_model_dir, tmp_path, monkeypatch, chunk):
    with engine(tmp_path, wide_model_dir, f"below{chunk}", chunk=chunk) as eng:
        want = serial(eng, DOC[:30], CONTS, monkeypatch, use_cache=False)
        got = eng.score(DOC[:30], CONTS, use_cache=False)
        assert {r.stats["mode"] for r in got} == {"batched"}
        assert_same(got, want)
        cold = eng.score(DOC[:30], CONTS)  # the context's state published: in full precision below the start
        cp = entry(eng, DOC[:29])
        assert cp.min_reusable_offset == 0 and {l.kind for l in cp.layers} == {"KVCache"}
        hit = eng.score(DOC[:30], CONTS)
        assert hit[0].stats["cached_tokens"] == 29 and hit[0].stats["mode"] == "batched"
        assert_same(cold, want)
        assert_same(hit, want)


def test_continuations_ending_exactly_at_the_start_convert_after_their_last_position(
        wide_model_dir, tmp_path, monkeypatch):
    conts = [ids(5, 1), ids(5, 2), ids(3, 3)]  # a context of 36: rows end at 40, 40 and 38
    with engine(tmp_path, wide_model_dir, "end") as eng:
        got = eng.score(DOC[:36], conts, use_cache=False)
        assert got[0].stats["mode"] == "batched"
        assert_same(got, serial(eng, DOC[:36], conts, monkeypatch, use_cache=False))


@pytest.mark.parametrize("n", [41, 60])
def test_a_context_past_the_start_batches_over_its_quantized_state_cold_and_from_the_cache(
        wide_model_dir, tmp_path, monkeypatch, n):
    """A context of 41 converts at the end of its prefill, one of 60 inside it: the rows start
    converted, over the quantized checkpoint (published: it serves lengths >= the start only)."""
    with engine(tmp_path, wide_model_dir, f"past{n}") as eng:
        want = serial(eng, DOC[:n], CONTS, monkeypatch, use_cache=False)
        cold = eng.score(DOC[:n], CONTS, use_cache=False)
        assert cold[0].stats["mode"] == "batched" and cold[0].stats["cached_tokens"] == 0
        assert_same(cold, want)
        eng.score(DOC[:n], CONTS)
        cp = entry(eng, DOC[: n - 1])
        assert cp.min_reusable_offset == START and {l.kind for l in cp.layers} == {"QuantizedKVCache"}
        assert not cp.can_serve(START - 1)
        hit = eng.score(DOC[:n], CONTS)  # from that quantized checkpoint
        assert hit[0].stats["mode"] == "batched" and hit[0].stats["cached_tokens"] == n - 1
        assert_same(hit, want)
    with engine(tmp_path, wide_model_dir, f"past{n}-longer") as eng:
        eng.generate_tokens(DOC[:70], max_tokens=1)  # a longer quantized state, cut to n - 1
        hit = eng.score(DOC[:n], CONTS)
        assert hit[0].stats["cached_tokens"] == n - 1 and hit[0].stats["mode"] == "batched"
        assert_same(hit, want)


def test_scores_of_a_delayed_quantization_from_the_cache_equal_cold_ones(wide_model_dir, tmp_path):
    conts = [ids(6, s) for s in range(3)]
    with engine(tmp_path, wide_model_dir, "score") as eng:
        eng.generate_tokens(DOC[:30], max_tokens=1)
        hit = eng.score(DOC[:60], conts)  # from full precision below the start, the prefill crossing it
        cold_scores = eng.score(DOC[:60], conts, use_cache=False)
        assert hit[0].stats["cached_tokens"] == 30 and hit[0].stats["mode"] == cold_scores[0].stats["mode"] == "batched"
        assert [s.greedy for s in hit] == [s.greedy for s in cold_scores]
        assert max(abs(a - b) for s, t in zip(hit, cold_scores)
                   for a, b in zip(s.token_logprobs, t.token_logprobs)) < 5e-3  # (8-bit KV: chunking moves more)


def test_kv_quantized_from_the_first_token_batches_too(wide_model_dir, tmp_path, monkeypatch):
    with engine(tmp_path, wide_model_dir, "zero", start=0) as eng:
        got = eng.score(DOC[:30], CONTS)
        assert got[0].stats["mode"] == "batched"
        assert_same(got, serial(eng, DOC[:30], CONTS, monkeypatch, use_cache=False))
