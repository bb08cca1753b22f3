"""What a hit costs and holds (kv/borrowed.py, kv/codecs.py): a loan copies nothing, the first
append copies the prefix once into the borrower's own buffer and from then on the borrower is
mlx-lm's KVCache operation for operation; branches share the document's memory; RAM holds KV
rather than growth padding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.kv.borrowed import BorrowedKVCache, BorrowedQuantizedKVCache, Buffer, Segment


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


DOC = ids(300, 21)  # longer than MERGE_TOKENS: publications share it instead of folding it in
QUESTIONS = [ids(6 + i, 100 + i) for i in range(8)]


# --- the cache itself ----------------------------------------------------------


def _flat(x) -> list:
    return [np.array(a) for a in (x if isinstance(x, tuple) else (x,))]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("append"), st.integers(1, 300)),
                          st.tuples(st.just("trim"), st.integers(0, 200))), min_size=1, max_size=12),
       st.lists(st.integers(1, 400), max_size=4), st.booleans())
def test_a_borrowed_cache_is_mlx_lms_cache_fed_the_same_positions(ops, prefix_lengths, quantized):
    """Any appends and trims over any lent segments: every fetch returns what mlx-lm's KVCache
    (or QuantizedKVCache) returns, bit for bit and shape for shape (its growth padding too), the
    attention over it is mlx-lm's own, and the lender's segments never change."""
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
    if ref.offset:  # a cache made the way mlx-lm makes one from a prefix: one buffer of it
        ref = _refilled(ref, quantized)
    c = BorrowedQuantizedKVCache(segments, group_size=32, bits=8) if quantized else BorrowedKVCache(segments)
    assert c.nbytes == 0  # a loan holds nothing of its own
    for op, n in ops:
        if op == "append":
            k, v = mx.random.normal((1, 2, n, D)), mx.random.normal((1, 2, n, D))
            got, want = c.update_and_fetch(k, v), ref.update_and_fetch(k, v)
            for g, w in zip(got, want):
                for a, b in zip(_flat(g), _flat(w)):
                    assert a.shape == b.shape and np.array_equal(a, b)
            q = mx.random.normal((1, 4, n, D))
            mask = "causal" if n > 1 else None
            if quantized:
                assert c.bits == 8 and c.group_size == 32  # mlx-lm's attention takes its quantized path
                att = quantized_scaled_dot_product_attention(mx.array(q), *got, scale=0.3, mask=mask, group_size=32,
                                                             bits=8)
                ref_att = quantized_scaled_dot_product_attention(mx.array(q), *want, scale=0.3, mask=mask,
                                                                 group_size=32, bits=8)
            else:
                att = mx.fast.scaled_dot_product_attention(q, *got, scale=0.3, mask=mask)
                ref_att = mx.fast.scaled_dot_product_attention(q, *want, scale=0.3, mask=mask)
            assert np.array_equal(np.array(att), np.array(ref_att))
        else:
            assert c.trim(n) == ref.trim(n)
        assert c.offset == ref.offset
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(lent, (b for s in segments for b in s.arrays)))


def _refilled(ref, quantized):
    """mlx-lm's cache as a borrower's first append makes it: the prefix in one buffer, no padding yet."""
    fresh = QuantizedKVCache(group_size=32, bits=8) if quantized else KVCache()
    whole = (*ref.keys, *ref.values) if quantized else (ref.keys, ref.values)
    arrays = [a[..., : ref.offset, :] for a in whole]
    if quantized:
        fresh.keys, fresh.values = tuple(arrays[:3]), tuple(arrays[3:])
    else:
        fresh.keys, fresh.values = arrays
    fresh.offset = ref.offset
    return fresh


def test_a_loan_copies_nothing_until_the_first_append_then_once(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir)
    m = eng.models.get()
    eng.generate_tokens(DOC + QUESTIONS[0], max_tokens=4)
    loan = eng.cache.take(DOC + QUESTIONS[1], m.namespace)
    lender = {id(l.segments[0].buffer) for l in loan.entry.checkpoint.layers}
    assert all(c.nbytes == 0 and len(c.lent) == 1 for c in loan.caches)  # views only
    m.model(mx.array(QUESTIONS[1])[None], cache=loan.caches)
    first = [tuple(id(b) for b in c.buffers) for c in loan.caches]
    for _ in range(3):
        m.model(mx.array([[7]]), cache=loan.caches)
    for c, ids_before in zip(loan.caches, first):  # one buffer of its own, not copied again
        assert tuple(id(b) for b in c.buffers) == ids_before and c.offset == loan.length + len(QUESTIONS[1]) + 3
        assert id(c.lent[0].buffer) in lender and c.lent[0].length == loan.length  # the loan still the lender's
    loan.release()
    eng.close()


def _addresses(entry, first_only: bool = False) -> list[int]:
    """Where the entry's whole buffers are in memory."""
    return [np.asarray(p).__array_interface__["data"][0]
            for l in entry.checkpoint.layers for s in l.segments[: 1 if first_only else None] for p in s.parents]


@pytest.mark.parametrize("ssd,flushed", [(False, False), (True, True), (True, False)])
def test_a_rerun_appends_into_the_entrys_buffers_in_place(tiny_model_dir, tmp_path, ssd, flushed):
    """A rerun takes the entry's place at its prompt (shorter than the entry: the old answer
    follows) and writes over the old answer in the same memory: no copy of the prefix, with the
    entry's write committed, queued (dropped) or without an SSD tier."""
    eng = Engine(cache_dir=tmp_path / "c", ssd=ssd)
    eng.load_model(tiny_model_dir)
    prompt = DOC + QUESTIONS[0]
    first = eng.generate_tokens(prompt, max_tokens=6)
    if flushed:
        eng.flush()
    [entry] = eng.cache.entries()
    before = _addresses(entry)
    del entry
    again = eng.generate_tokens(prompt, max_tokens=6)
    assert again.tokens == first.tokens and again.stats["cache_source"] == "ram"
    [entry] = eng.cache.entries()
    assert _addresses(entry) == before
    eng.close()


# --- a second question over a cached document ------------------------------------


@pytest.fixture(scope="module")
def cold(tiny_model_dir, tmp_path_factory):
    with Engine(cache_dir=tmp_path_factory.mktemp("ref"), ssd=False) as ref:
        ref.load_model(tiny_model_dir)
        return [ref.generate_tokens(DOC + q, max_tokens=10, use_cache=False).tokens
                for q in QUESTIONS]


def test_branches_of_a_document_share_it_and_continue_exactly(tiny_model_dir, tmp_path, cold):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir)
    first = eng.generate_tokens(DOC + QUESTIONS[0], max_tokens=40)  # its answer: room for each question's
    assert first.tokens[:10] == cold[0]
    doc_entry = eng.cache.entries()[0]
    doc_bytes = [np.array(a).tobytes() for a in doc_entry.checkpoint.arrays()]
    doc_memory = _addresses(doc_entry, first_only=True)
    for i, (q, want) in enumerate(zip(QUESTIONS[1:], cold[1:])):
        r = eng.generate_tokens(DOC + q, max_tokens=10)
        assert r.stats["cache_source"] == "ram" and r.stats["cached_tokens"] >= len(DOC)
        assert r.tokens == want
        assert eng.stats()["handovers_lent"] == i + 1  # each appended into the document's buffers in place
    entries = eng.cache.entries()
    assert len(entries) == len(QUESTIONS)
    for e in entries:  # every branch reads the document from the first entry's memory
        assert _addresses(e, first_only=True) == doc_memory
    assert [np.array(a).tobytes() for a in doc_entry.checkpoint.arrays()] == doc_bytes
    s = eng.stats()
    doc_kv = doc_entry.checkpoint.kv_bytes
    assert s["ram_kv_bytes"] < 2 * doc_kv  # the document counted once
    assert s["ram_used_bytes"] <= 1.25 * s["ram_kv_bytes"]
    eng.close()


def test_a_loan_in_place_that_outgrows_the_room_or_is_interrupted_gives_the_document_back(tiny_model_dir, tmp_path,
                                                                                         cold):
    """A question whose answer passes the buffers' room grows them (one copy, as mlx-lm's KVCache grows):
    the document comes back over the larger buffer, its bytes unchanged, shared with the question's
    state. An interrupted question gives it back too."""
    eng = Engine(cache_dir=tmp_path / "c")
    eng.load_model(tiny_model_dir)
    assert eng.generate_tokens(DOC + QUESTIONS[0], max_tokens=10).tokens == cold[0]
    eng.flush()  # (a queued write holds views of the buffers: nothing is lent in place until it is done)
    [doc_entry] = eng.cache.entries()
    doc_bytes = [np.array(a).tobytes() for a in doc_entry.checkpoint.arrays()]
    where = _addresses(doc_entry, first_only=True)
    long = eng.generate_tokens(DOC + QUESTIONS[1], max_tokens=30)  # past the room (the first answer's 10)
    assert long.tokens[:10] == cold[1] and eng.stats()["handovers_lent"] == 1
    assert _addresses(doc_entry, first_only=True) != where  # it grew: the document moved with it
    entries = eng.cache.entries()
    assert doc_entry in entries and [np.array(a).tobytes() for a in doc_entry.checkpoint.arrays()] == doc_bytes
    assert len({tuple(_addresses(e, first_only=True)) for e in entries}) == 1  # one document in memory

    def stop(_text):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        eng.generate_tokens(DOC + QUESTIONS[2], max_tokens=10, on_text=stop)
    assert doc_entry in eng.cache.entries()
    assert [np.array(a).tobytes() for a in doc_entry.checkpoint.arrays()] == doc_bytes
    assert eng.generate_tokens(DOC + QUESTIONS[3], max_tokens=10).tokens == cold[3]
    eng.close()


def test_a_borrower_never_writes_below_what_it_keeps():
    """Trimmed below `keep` and appended to, a borrower lent in place writes into copies: the kept
    positions stay as they were for those who view them again (share_back)."""
    k, v = mx.random.normal((1, 2, 40, 8)), mx.random.normal((1, 2, 40, 8))
    mx.eval(k, v)
    want = [np.array(k[..., :30, :]), np.array(v[..., :30, :])]
    c = BorrowedKVCache(hand_over=Segment((k, v), Buffer(0), (k, v)), offset=30, keep=30)
    c.update_and_fetch(mx.ones((1, 2, 5, 8)), mx.ones((1, 2, 5, 8)))
    c.trim(10)
    got = c.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    assert c.offset == 28 and float(mx.abs(got[0][..., 25:, :]).max()) == 0.0
    shared = c.share_back()
    assert shared.length == 30 and all(np.array_equal(np.array(a), w) for a, w in zip(shared.arrays, want))


def test_hit_logits_stay_within_float32_tolerance(tiny_model_dir):
    from mlx_lm import load

    model, _ = load(str(tiny_model_dir))
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
    assert max(diffs) == 0.0, diffs  # the same numbers in the same operations: bit for bit


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
