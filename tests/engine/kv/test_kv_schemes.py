"""KV schemes and exact boundaries: quantized KV, unsupported cache classes,
generated-token provenance in sessions, minimum reusable offsets, and a
property test that published checkpoints never change, for every cache kind."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache
from tiny_archs import build_arch_model

from mlxcache_kernel.engine import Checkpoint, Engine, ModelError, SamplingParams
from mlxcache_kernel.engine.cache.ssd.restore import restore


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


DOC = ids(120, 7)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A tiny llama with head_dim 32, so KV quantizes in groups of 32."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "wide", hidden=128)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_hits_equal_their_own_cold_runs(wide_model_dir, tmp_path, bits):
    eng = Engine(cache_dir=tmp_path / "c")
    info = eng.load_model(wide_model_dir, name="q", kv_bits=bits, kv_group_size=32, kv_start=0)
    assert info["kv_scheme"].startswith("QuantizedKVCache:") and info["kv_scheme"].endswith(f":q{bits}g32")
    for params in (SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, temperature=0.7, seed=5)):
        cold = eng.generate_tokens(DOC, params=params, use_cache=False).tokens
        first = eng.generate_tokens(DOC, params=params)
        hit = eng.generate_tokens(DOC, params=params)
        assert hit.stats["cache_source"] == "ram" and hit.stats["cached_tokens"] == len(DOC) - 1
        assert cold == first.tokens == hit.tokens
    entry = max(eng.cache.entries(), key=lambda e: len(e.tokens))
    assert {l.kind for l in entry.checkpoint.layers} == {"QuantizedKVCache"}
    assert all(l.meta["bits"] == bits for l in entry.checkpoint.layers)
    eng.flush()
    eng.close()
    # the SSD tier holds the quantized bytes: a new engine restores them
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as again:  # the lookup restores
        again.load_model(wide_model_dir, name="q", kv_bits=bits, kv_group_size=32, kv_start=0)
        r = again.generate_tokens(DOC, max_tokens=16)
        assert r.stats["cache_source"] == "ssd" and r.tokens == cold_greedy(wide_model_dir, tmp_path, bits)


def cold_greedy(model_dir, tmp_path, bits):
    with Engine(cache_dir=tmp_path / "ref", ssd=False) as ref:
        ref.load_model(model_dir, name="q", kv_bits=bits, kv_group_size=32, kv_start=0)
        return ref.generate_tokens(DOC, max_tokens=16, use_cache=False).tokens


def test_float_entries_never_serve_a_quantized_load(wide_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c")
    f = eng.load_model(wide_model_dir, name="f")
    q = eng.load_model(wide_model_dir, name="q8", kv_bits=8, kv_group_size=32, kv_start=0)
    assert f["namespace"] != q["namespace"]
    eng.generate_tokens(DOC, max_tokens=4, model="f")
    r = eng.generate_tokens(DOC, max_tokens=4, model="q8")
    assert r.stats["cached_tokens"] == 0 and r.stats["cache_source"] is None
    eng.flush()
    eng.close()
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as again:  # the lookup restores  # nor from SSD
        again.load_model(wide_model_dir, name="q4", kv_bits=4, kv_group_size=32, kv_start=0)
        assert again.generate_tokens(DOC, max_tokens=4).stats["cache_source"] is None


def test_bad_kv_scheme_is_a_clear_error(wide_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", ssd=False) as eng:
        with pytest.raises(ModelError, match="kv_bits"):
            eng.load_model(wide_model_dir, kv_bits=3)
        with pytest.raises(ModelError, match="kv_group_size"):
            eng.load_model(wide_model_dir, kv_bits=8, kv_group_size=48)
        assert eng.models.names() == []


class OddCache(KVCache):
    """A cache class no codec knows."""


def test_unknown_cache_class_generates_uncached_with_a_notice(wide_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(llama.Model, "make_cache", lambda self: [OddCache() for _ in self.layers], raising=False)
    eng = Engine(cache_dir=tmp_path / "c")
    seen = []
    eng.events.subscribe(seen.append)
    info = eng.load_model(wide_model_dir)
    assert "OddCache" in info["cache_notice"] and any(e["type"] == "notice" for e in seen)
    a = eng.generate_tokens(DOC, max_tokens=8)
    b = eng.generate_tokens(DOC, max_tokens=8)
    assert a.tokens == b.tokens and b.stats["cache_source"] is None
    assert eng.cache.entries() == []
    eng.close()


def test_session_reuses_generated_ids_that_would_retokenize_differently(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir)
    tok = eng.models.get().tokenizer
    t1 = eng.generate("Tell me something long.", max_tokens=40, session="s")
    history = t1.prompt_tokens + t1.tokens
    # random byte ids decode to invalid UTF-8 here: the reply's text re-encodes to other ids
    assert list(tok.encode(tok.decode(history), add_special_tokens=False)) != history
    t2 = eng.generate("And now?", max_tokens=8, session="s")
    assert t2.prompt_tokens[: len(history)] == history
    assert t2.stats["cached_tokens"] >= len(history) - 1
    assert tok.decode(t2.prompt_tokens) == tok.apply_chat_template(
        eng.sessions.get("s").messages[:2] + [{"role": "user", "content": "And now?"}],
        add_generation_prompt=True, tokenize=False,
    )
    eng.close()


def test_recurrent_chat_turn_reuses_the_whole_history(tmp_path):
    path = build_arch_model("qwen3_next", tmp_path / "m")
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(path)
    t1 = eng.generate("A first question, asked at some length.", max_tokens=20, session="s")
    t2 = eng.generate("A second one.", max_tokens=8, session="s")
    # the recurrent state of turn 1's end (prompt + reply but its last token) is exact
    assert t2.stats["cached_tokens"] == len(t1.prompt_tokens) + len(t1.tokens) - 1
    eng.close()


def make_kv_checkpoint(tokens, min_reusable_offset=0):
    c = KVCache()
    k = mx.arange(len(tokens) * 4, dtype=mx.float32).reshape(1, 1, len(tokens), 4)
    c.update_and_fetch(k, k + 1)
    return Checkpoint.capture(tokens, [c], min_reusable_offset=min_reusable_offset)


def test_minimum_reusable_offset_end_to_end(tmp_path):
    """Selection, supersession, the file header and the SSD index all honor it."""
    eng = Engine(cache_dir=tmp_path / "c")
    identity = {"artifact": "a", "config": "c", "tokenizer": "t", "kv_scheme": "k", "runtime": "r"}
    eng.cache.register_namespace("ns", identity)
    short = tuple(range(1, 41))
    eng.cache.put(make_kv_checkpoint(short), "ns")
    long = make_kv_checkpoint(tuple(range(1, 101)), min_reusable_offset=60)
    eng.cache.put(long, "ns")
    # the longer entry cannot serve 40 tokens: it did not supersede the shorter one
    assert eng.cache.get_exact(short, "ns") is not None
    lease = eng.cache.take(list(range(1, 51)) + [999], "ns")
    assert lease.length == 40 and lease.entry.tokens == short  # 50 < 60: only the short entry serves
    lease.release()
    lease = eng.cache.take(list(range(1, 71)) + [999], "ns")
    assert lease.length == 70 and lease.entry.tokens == long.tokens
    lease.release()
    eng.flush()
    store = eng.cache.store
    [h] = [h for h in store.entries() if len(h.tokens) == 100]
    assert h.min_reusable_offset == 60
    assert store.find(list(range(1, 51)) + [999], "ns").match_len == 40  # the index skips the long file
    assert store.find(list(range(1, 71)) + [999], "ns").match_len == 70
    assert restore(store, h).min_reusable_offset == 60
    eng.close()


# --- property: published checkpoints are immutable, for every cache kind ----

KIND_ARCHS = ["llama", "gemma3_text", "qwen3_next", "llama4", "baichuan_m1"]
BASE = ids(300, 11)  # past MERGE_TOKENS: borrowers keep the shared prefix apart and append their own
PROMPTS = [BASE, BASE + ids(1, 12), BASE[:280] + ids(20, 13), BASE + ids(30, 14), BASE[:299], BASE[:40] + ids(9, 15)]


def digest(cp) -> str:
    return hashlib.sha256(b"".join(np.array(a).tobytes() for a in cp.arrays())).hexdigest()


@pytest.fixture(scope="module")
def kind_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    return {arch: build_arch_model(arch, root / arch) for arch in KIND_ARCHS}


def held_bytes(entries) -> int:
    """RAM the entries hold, each shared buffer once (recounted from scratch)."""
    buffers, own = {}, 0
    for e in entries:
        mine = {id(s.buffer): s.buffer for l in e.checkpoint.layers for s in l.all_segments()}
        buffers.update(mine)
        own += e.checkpoint.nbytes - sum(b.nbytes for b in mine.values())
    return sum(b.nbytes for b in buffers.values()) + own


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arch=st.sampled_from(KIND_ARCHS),
    ops=st.lists(st.tuples(st.sampled_from(["generate", "take", "put"]), st.integers(0, len(PROMPTS) - 1)),
                 min_size=1, max_size=8),
)
def test_published_checkpoints_never_change(kind_models, tmp_path_factory, arch, ops):
    eng = Engine(cache_dir=tmp_path_factory.mktemp("prop"), write_behind=True)
    eng.load_model(kind_models[arch], name="m")
    m, seen = eng.models.get(), {}
    for op, i in ops:
        prompt = PROMPTS[i]
        if op == "generate":
            eng.generate_tokens(prompt, max_tokens=5, temperature=0.9, seed=i)
        else:
            lease = eng.cache.take(prompt, m.namespace, move=True)
            if lease is not None:  # decode into the borrowed state, as a generation would
                m.model(mx.array(prompt[lease.length:] + [5, 6])[None], cache=lease.caches)
                mx.eval([c.state for c in lease.caches])
                if op == "put":
                    eng.cache.put(Checkpoint.capture(prompt + [5, 6], lease.caches), m.namespace)
                lease.release()
        for e in eng.cache.entries():
            d = digest(e.checkpoint)
            assert seen.setdefault(id(e.checkpoint), (e.checkpoint, d))[1] == d
        assert eng.cache.ram.used_bytes == held_bytes(eng.cache.entries())
    assert eng.flush()["failed"] == [] and eng.cache_verify() == []
    eng.close()
