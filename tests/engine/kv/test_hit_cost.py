"""A hit never copies the shared prefix, branches share the document's memory,
and RAM holds KV rather than growth padding (kv/borrowed.py, kv/codecs.py).

Exactness: attention split into prefix pieces gives the same scores and
softmax as MLX's own; only the final sum differs by float rounding. These
tests check greedy tokens equal a cold run and bound the logit difference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import llama
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxcache_kernel.engine import Engine, SamplingParams
from mlxcache_kernel.engine.kv import borrowed
from mlxcache_kernel.engine.kv.borrowed import (BorrowedKVCache, BorrowedQuantizedKVCache, Buffer, Segment,
                                                piecewise_attention, piecewise_quantized_attention)


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


DOC = ids(300, 21)  # longer than MERGE_TOKENS: borrowers keep it apart instead of copying it
QUESTIONS = [ids(6 + i, 100 + i) for i in range(8)]


# --- the attention itself ------------------------------------------------------


@pytest.mark.parametrize("rep", [1, 3])
@pytest.mark.parametrize("L", [1, 5])
@pytest.mark.parametrize("mask_kind", [None, "causal", "bool", "additive", "sinks"])
def test_piecewise_attention_matches_mlx(rep, L, mask_kind):
    mx.random.seed(L * 10 + rep)
    n_kv, D, T = 2, 16, 70
    q = mx.random.normal((1, n_kv * rep, L, D))
    k, v = mx.random.normal((1, n_kv, T, D)), mx.random.normal((1, n_kv, T, D))
    mask, sinks = None, None
    if mask_kind == "causal":
        mask = "causal" if L > 1 else None
    elif mask_kind == "bool":
        mask = create_causal_mask(L, T - L, window_size=20)
    elif mask_kind == "additive":
        mask = mx.random.normal((L, T))
    elif mask_kind == "sinks":
        sinks = mx.random.normal((n_kv * rep,))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask, sinks=sinks)
    pieces = [(k[..., a:b, :], v[..., a:b, :]) for a, b in ((0, 33), (33, 40), (40, T))]
    got = piecewise_attention(q, pieces, 0.25, mask, sinks)
    assert got.shape == want.shape
    assert float(mx.abs(got - want).max()) < 1e-5


@pytest.mark.parametrize("rep", [1, 2])
@pytest.mark.parametrize("mask_kind", [None, "causal", "bool"])
def test_piecewise_quantized_attention_matches_mlx_lm(rep, mask_kind):
    mx.random.seed(rep)
    n_kv, D, T, L = 2, 64, 90, 4
    q = mx.random.normal((1, n_kv * rep, L, D))
    k = mx.quantize(mx.random.normal((1, n_kv, T, D)), group_size=32, bits=8)
    v = mx.quantize(mx.random.normal((1, n_kv, T, D)), group_size=32, bits=8)
    mask = {"causal": "causal", "bool": create_causal_mask(L, T - L, window_size=50), None: None}[mask_kind]
    # mlx-lm's scales its queries in place (queries *= scale): give it a copy
    want = quantized_scaled_dot_product_attention(mx.array(q), k, v, scale=0.125, mask=mask, group_size=32, bits=8)
    cut = lambda x, a, b: tuple(p[..., a:b, :] for p in x)
    pieces = [(cut(k, a, b), cut(v, a, b)) for a, b in ((0, 50), (50, 61), (61, T))]
    got = piecewise_quantized_attention(q, pieces, 0.125, mask, 32, 8)
    assert float(mx.abs(got - want).max()) < 1e-4


def test_a_cache_without_prefix_is_a_plain_kv_cache():
    c, k = BorrowedKVCache(), mx.random.normal((1, 2, 5, 8))
    keys, values = c.update_and_fetch(k, k + 1)
    assert keys.shape == (1, 2, 5, 8) and c.offset == 5 and c.prefix == []
    assert borrowed._FETCHED.get(id(keys)) is None  # mlx's own attention, bit for bit


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("append"), st.integers(1, 300)),
                          st.tuples(st.just("trim"), st.integers(0, 200))), min_size=1, max_size=12),
       st.lists(st.integers(1, 400), max_size=4), st.booleans())
def test_a_borrowed_cache_holds_what_a_plain_one_holds(ops, prefix_lengths, quantized):
    """Any appends and trims over any prefix segments: the same keys, values and attention
    as mlx-lm's KVCache (or QuantizedKVCache) fed the same positions, and the lender's
    segments never change."""
    mx.random.seed(len(ops))
    D = 32 if quantized else 8
    ref = QuantizedKVCache(group_size=32, bits=8) if quantized else KVCache()
    segments = []
    for n in prefix_lengths:
        k, v = mx.random.normal((1, 2, n, D)), mx.random.normal((1, 2, n, D))
        ref.update_and_fetch(k, v)
        whole = (*ref.keys, *ref.values) if quantized else (ref.keys, ref.values)
        at = ref.offset - n
        segments.append(Segment(tuple(mx.array(a[..., at : ref.offset, :]) for a in whole), Buffer(0)))
    lent = [np.array(a) for s in segments for a in s.arrays]
    c = BorrowedQuantizedKVCache(segments, group_size=32, bits=8) if quantized else BorrowedKVCache(segments)
    for op, n in ops:
        if op == "append":
            k, v = mx.random.normal((1, 2, n, D)), mx.random.normal((1, 2, n, D))
            c.update_and_fetch(k, v)
            ref.update_and_fetch(k, v)
            q = mx.random.normal((1, 4, n, D))
            mask = "causal" if n > 1 else None
            if quantized:
                want = quantized_scaled_dot_product_attention(mx.array(q), *ref.keys_and_values(), scale=0.3,
                                                              mask=mask, group_size=32, bits=8)
            else:
                want = mx.fast.scaled_dot_product_attention(q, *ref.keys_and_values(), scale=0.3, mask=mask)
            assert float(mx.abs(c.attend(q, 0.3, mask) - want).max()) < 1e-4
        else:
            assert c.trim(n) == ref.trim(n)
        assert c.offset == ref.offset
        if ref.offset:
            for got, want in zip(c._whole(), ref.keys_and_values()):
                for a, b in zip(got if quantized else (got,), want if quantized else (want,)):
                    assert np.array_equal(np.array(a), np.array(b))
        assert len(c.prefix) <= 2 + len(prefix_lengths) + ref.offset // 256
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(lent, (b for s in segments for b in s.arrays)))


# --- a second question over a cached document ------------------------------------


@pytest.fixture(scope="module")
def cold(tiny_model_dir, tmp_path_factory):
    with Engine(cache_dir=tmp_path_factory.mktemp("ref"), ssd=False) as ref:
        ref.load_model(tiny_model_dir)
        return [ref.generate_tokens(DOC + q, SamplingParams(max_tokens=10), use_cache=False).tokens
                for q in QUESTIONS]


def test_branches_of_a_document_share_it_and_continue_exactly(tiny_model_dir, tmp_path, cold):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir)
    first = eng.generate_tokens(DOC + QUESTIONS[0], SamplingParams(max_tokens=10))
    assert first.tokens == cold[0]
    doc_entry = eng.cache.entries()[0]
    doc_bytes = [np.array(a).tobytes() for a in doc_entry.checkpoint.arrays()]
    doc_buffer_ids = {id(s.buffer) for l in doc_entry.checkpoint.layers for s in l.segments}
    for q, want in zip(QUESTIONS[1:], cold[1:]):
        r = eng.generate_tokens(DOC + q, SamplingParams(max_tokens=10))
        assert r.stats["cache_source"] == "ram" and r.stats["cached_tokens"] >= len(DOC)
        assert r.tokens == want
    entries = eng.cache.entries()
    assert len(entries) == len(QUESTIONS)
    for e in entries:  # every branch reads the document from the first entry's buffers
        assert {id(l.segments[0].buffer) for l in e.checkpoint.layers} <= doc_buffer_ids
    assert [np.array(a).tobytes() for a in doc_entry.checkpoint.arrays()] == doc_bytes
    s = eng.stats()
    doc_kv = doc_entry.checkpoint.kv_bytes
    assert s["ram_kv_bytes"] < 2 * doc_kv  # the document counted once
    assert s["ram_used_bytes"] <= 1.25 * s["ram_kv_bytes"]
    eng.close()


def test_a_borrower_appends_without_copying_the_prefix(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir)
    m = eng.models.get()
    eng.generate_tokens(DOC + QUESTIONS[0], SamplingParams(max_tokens=4))
    lease = eng.cache.take(DOC + QUESTIONS[1], m.namespace)
    lender = {id(l.segments[0].buffer) for l in lease.entry.checkpoint.layers}
    m.model(mx.array(QUESTIONS[1])[None], cache=lease.caches)
    for _ in range(3):
        m.model(mx.array([[7]]), cache=lease.caches)
    for c in lease.caches:  # still the lender's views: nothing was joined or copied
        assert len(c.prefix) == 1 and id(c.prefix[0].buffer) in lender and c.prefix[0].length == lease.length
        assert c.tail_len == c.offset - lease.length == len(QUESTIONS[1]) + 3
    lease.release()
    eng.close()


def test_hit_logits_stay_within_float32_tolerance(tiny_model_dir):
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
    with borrowed.routed():
        _check_hit_logits(model)


def _check_hit_logits(model):
    ref, donor = make_prompt_cache(model), make_prompt_cache(model)
    model(mx.array(DOC)[None], cache=ref)
    model(mx.array(DOC)[None], cache=donor)
    caches = [BorrowedKVCache([Segment((c.keys[..., :len(DOC), :], c.values[..., :len(DOC), :]), Buffer(0))])
              for c in donor]
    want = model(mx.array(QUESTIONS[2])[None], cache=ref)
    got = model(mx.array(QUESTIONS[2])[None], cache=caches)
    diffs = [float(mx.abs(got - want).max())]
    for t in (5, 9, 11):
        want, got = model(mx.array([[t]]), cache=ref), model(mx.array([[t]]), cache=caches)
        diffs.append(float(mx.abs(got - want).max()))
    scale = float(mx.abs(want).max())
    assert max(diffs) <= 1e-5 * max(1.0, scale), diffs


def test_a_model_that_attends_some_other_way_gets_the_whole_keys(tiny_model_dir, tmp_path, monkeypatch, cold):
    """Bypassing the piecewise attention is correct (the lazy joined keys) and collapses the
    cache into one buffer of its own at its next update."""
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir)
    monkeypatch.setattr(llama, "scaled_dot_product_attention", borrowed._ORIGINAL)
    m = eng.models.get()
    eng.generate_tokens(DOC + QUESTIONS[0], SamplingParams(max_tokens=4))
    r = eng.generate_tokens(DOC + QUESTIONS[3], SamplingParams(max_tokens=10))
    assert r.stats["cached_tokens"] >= len(DOC) and r.tokens == cold[3]
    lease = eng.cache.take(DOC + QUESTIONS[4], m.namespace)
    m.model(mx.array(QUESTIONS[4])[None], cache=lease.caches)
    m.model(mx.array([[5]]), cache=lease.caches)
    assert all(c.prefix == [] for c in lease.caches)
    lease.release()
    eng.close()


# --- RAM holds KV --------------------------------------------------------------


def test_ram_holds_kv_after_short_prompts_and_a_chat(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir)
    for i in range(12):
        eng.generate(f"Short prompt number {i}: say something.", max_tokens=8)
    s = eng.stats()
    assert s["ram_entries"] >= 12 and s["ram_used_bytes"] <= 1.25 * s["ram_kv_bytes"]
    for turn in range(20):
        eng.generate(f"Turn {turn}: one more fact, please.", max_tokens=12, session="chat")
    s = eng.stats()
    assert s["ram_used_bytes"] <= 1.25 * s["ram_kv_bytes"]
    eng.close()


def test_a_rerun_and_a_chat_turn_keep_few_segments(tiny_model_dir, tmp_path):
    """Each turn borrows the last one; kept segments shrink geometrically (borrowed.to_merge)."""
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir)
    for turn in range(25):
        eng.generate(f"Turn {turn}: " + "tell me more " * 6, max_tokens=16, session="chat")
    entry = eng.cache.session_entry("chat", eng.models.get().namespace)
    n = len(entry.tokens)
    assert n > 1000
    assert all(len(l.segments) <= 2 + int(np.log2(n / 256)) for l in entry.checkpoint.layers)
    eng.close()
