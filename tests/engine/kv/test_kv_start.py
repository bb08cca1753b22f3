"""A delayed KV quantization (kv_bits with kv_start, mlx-lm's --quantized-kv-start): the caches
convert at exactly kv_start whatever the chunking or where a hit left off, so a cold run and
every hit agree; a checkpoint past the start serves only prompts at least that long."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from remote_fixtures import kind, server  # noqa: F401  (fixtures)
from tiny_archs import build_arch_model

from mlxcache_kernel.engine import Engine, ModelError, SamplingParams
from mlxcache_kernel.engine.kv.inspect import kv_info
from mlxcache_kernel.engine.kv.quantize_start import QuantizeFrom

START = 40
GREEDY, SEEDED = SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.8, seed=3)


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


DOC = ids(90, 11)


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "wide", hidden=128)  # head_dim 32


def engine(tmp_path, model_dir, *, chunk: int = 512, start: int = START, name: str = "c", **kw) -> Engine:
    eng = Engine(cache_dir=tmp_path / name, prefill_chunk=chunk, **kw)
    eng.load_model(model_dir, name="q", kv_bits=8, kv_group_size=32, kv_start=start)
    return eng


def cold(tmp_path, model_dir, prompt, params, chunk=512, start=START) -> list:
    with engine(tmp_path, model_dir, chunk=chunk, start=start, name=f"cold{chunk}", ssd=False) as eng:
        return eng.generate_tokens(prompt, params=params, use_cache=False).tokens


NEW_PROCESS = """
import json
from mlxcache_kernel.engine import Engine, SamplingParams
with Engine(cache_dir={cache!r}, prefetch_budget_bytes=0) as eng:
    eng.load_model({model!r}, name="q", kv_bits=8, kv_group_size=32, kv_start={start})
    r = eng.generate_tokens({doc!r}, **{params!r})
    cp = max(eng.cache.entries(), key=lambda e: len(e.tokens)).checkpoint
    print(json.dumps({{"source": r.stats["cache_source"], "tokens": r.tokens,
                      "min_reusable_offset": cp.min_reusable_offset}}))
"""


def longest(eng: Engine):
    return max(eng.cache.entries(), key=lambda e: len(e.tokens)).checkpoint


def test_the_conversion_happens_at_exactly_the_start_whatever_the_chunking(wide_model_dir, tmp_path):
    for params in (GREEDY, SEEDED):
        runs = {chunk: cold(tmp_path, wide_model_dir, DOC, params, chunk) for chunk in (1, 7, 512)}
        assert runs[1] == runs[7] == runs[512], runs
    # mlx-lm would convert after the chunk that passes the start (at 42 with chunks of 7): here the
    # forward of 35..50 is split at 40, so its output is that of a run converted by hand at 40 (the
    # same forwards: equal to the bit; another split would move float32 roundings across
    # quantization steps, which on this model is up to ~0.1 in a logit)
    with engine(tmp_path, wide_model_dir, ssd=False, name="hand") as eng:
        m = eng.models.get("q")
        by_hand = m.new_caches()
        m.model(mx.array(DOC[:35])[None], cache=by_hand)
        head = m.model(mx.array(DOC[35:START])[None], cache=by_hand)
        QuantizeFrom(m.model, START, 8, 32).convert(by_hand)
        want = mx.concatenate([head, m.model(mx.array(DOC[START:50])[None], cache=by_hand)], axis=1)
        caches = m.new_caches()
        m.model(mx.array(DOC[:35])[None], cache=caches)
        got = m.forward(mx.array(DOC[35:50])[None], cache=caches)
        assert all(getattr(c, "bits", None) == 8 and c.offset == 50 and c.quantized_from == START for c in caches)
        assert mx.array_equal(got, want).item()
        late = m.new_caches()  # converted at 42 (mlx-lm's way with chunks of 7): other numbers
        m.model(mx.array(DOC[:42])[None], cache=late)
        QuantizeFrom(m.model, 42, 8, 32).convert(late)
        assert not mx.array_equal(m.model(mx.array(DOC[42:50])[None], cache=late), want[:, 7:]).item()


def test_hits_below_and_past_the_start_equal_a_cold_run(wide_model_dir, tmp_path):
    below, past = DOC[:30], DOC[:60]
    for params in (GREEDY, SEEDED):
        want = cold(tmp_path, wide_model_dir, DOC, params)
        with engine(tmp_path, wide_model_dir, name=f"hits{params.seed}") as eng:
            eng.generate_tokens(below, max_tokens=1)  # a full-precision checkpoint below
            [fp] = [e.checkpoint for e in eng.cache.entries()]
            assert fp.min_reusable_offset == 0 and {l.kind for l in fp.layers} == {"KVCache"}
            r = eng.generate_tokens(DOC, params=params)  # a hit from below, crossing the start
            assert r.stats["cached_tokens"] == len(below) and r.tokens == want
            cp = longest(eng)
            assert cp.min_reusable_offset == START and {l.kind for l in cp.layers} == {"QuantizedKVCache"}
            assert all(l.meta["from"] == START for l in cp.layers)
            assert {r["quantized"] for r in kv_info(cp)} == {f"q8g32 from {START}"}  # what %kv inspect shows
            assert {r["quantized"] for r in kv_info(fp)} == {""}
            # the full-precision ancestor stays: the quantized descendant cannot serve it
            assert any(e.checkpoint.min_reusable_offset == 0 and len(e.tokens) >= len(below) - 1
                       for e in eng.cache.entries()), [(len(e.tokens), e.checkpoint.min_reusable_offset)
                                                       for e in eng.cache.entries()]
            eng.generate_tokens(past, max_tokens=1)
            r2 = eng.generate_tokens(DOC, params=params)  # a hit from a quantized checkpoint past the start
            assert r2.stats["cached_tokens"] >= len(past) and r2.tokens == want
            eng.flush()
        # from SSD, in a new process (the offset is in the file and the catalogue)
        script = NEW_PROCESS.format(cache=str(tmp_path / f"hits{params.seed}"), model=str(wide_model_dir),
                                    start=START, doc=DOC, params=params.as_dict())
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got == {"source": "ssd", "tokens": want, "min_reusable_offset": START}


def test_a_prompt_shorter_than_the_start_never_takes_a_quantized_checkpoint(wide_model_dir, tmp_path):
    short = DOC[:START - 5] + ids(8, 2)  # shares 35 tokens with DOC, ends before the start
    want = cold(tmp_path, wide_model_dir, short, GREEDY)
    with engine(tmp_path, wide_model_dir, name="short") as eng:
        eng.generate_tokens(DOC, params=GREEDY)  # only quantized checkpoints (from 40) in the cache
        assert all(e.checkpoint.min_reusable_offset == START for e in eng.cache.entries())
        r = eng.generate_tokens(short, params=GREEDY)
        assert r.stats["cached_tokens"] == 0 and r.tokens == want
        eng.flush()
    with engine(tmp_path, wide_model_dir, name="short", prefetch_budget_bytes=0) as again:
        r = again.generate_tokens(short[:-1] + [5], params=GREEDY)  # SSD holds both kinds now
        assert r.tokens == cold(tmp_path, wide_model_dir, short[:-1] + [5], GREEDY)


def test_a_decode_that_crosses_the_start_converts_there(wide_model_dir, tmp_path):
    prompt = DOC[:START - 4]  # the 4th generated token's forward reaches the start
    params = SamplingParams(max_tokens=10)
    want = cold(tmp_path, wide_model_dir, prompt, params)
    with engine(tmp_path, wide_model_dir, name="decode") as eng:
        r = eng.generate_tokens(prompt, params=params)
        assert r.tokens == want
        cp = longest(eng)
        assert cp.min_reusable_offset == START and len(cp.tokens) >= START
        again = eng.generate_tokens(prompt, params=params)  # served by the full-precision prompt state
        assert again.tokens == want and again.stats["cached_tokens"] > 0


def test_sliding_window_layers_stay_in_full_precision_and_hits_are_exact(tmp_path):
    path = build_arch_model("gemma3_text", tmp_path / "gemma3", head_dim=32)
    eng = Engine(cache_dir=tmp_path / "g")
    info = eng.load_model(path, name="g", kv_bits=8, kv_group_size=32, kv_start=START)
    assert info["kv_start"] == START and info["kv_scheme"].endswith(f"q8g32@{START}")
    with Engine(cache_dir=tmp_path / "gcold", ssd=False) as ref:
        ref.load_model(path, name="g", kv_bits=8, kv_group_size=32, kv_start=START)
        want = ref.generate_tokens(DOC, params=GREEDY, use_cache=False).tokens
    assert eng.generate_tokens(DOC, params=GREEDY).tokens == want
    r = eng.generate_tokens(DOC, params=GREEDY)
    assert r.stats["cached_tokens"] > START and r.tokens == want
    kinds = {l.kind for l in longest(eng).layers}
    assert kinds == {"RotatingKVCache", "QuantizedKVCache"}
    eng.close()


def _kv(cp) -> list:
    """Every layer's keys and values as float32 numpy (a quantized layer's dequantized)."""
    out = []
    for l in cp.layers:
        a = l.arrays
        if l.kind == "QuantizedKVCache":
            a = [mx.dequantize(*a[i : i + 3], group_size=l.meta["group_size"], bits=l.meta["bits"]) for i in (0, 3)]
        out += [np.asarray(x.astype(mx.float32)) for x in a]
    return out


def test_batch_rows_convert_at_exactly_the_start_each_at_its_own_step(wide_model_dir, tmp_path):
    """Rows over a shared full-precision prefix (30) reach the start (40) inside their rests, at a
    rest's last position, in their decode, or never: they batch, each converts at exactly 40
    whatever the chunking, and the batch from the cache is the batch without it."""
    prompts = [DOC[:30] + ids(20, 0), DOC[:30] + ids(11, 1), DOC[:30] + ids(4, 2), DOC[:30] + ids(7, 3) + DOC[:2]]
    params = dict(max_tokens=12)
    singles = {}
    for p in prompts:  # each row alone, cold: its final state
        with engine(tmp_path, wide_model_dir, name="single", ssd=False) as eng:
            r = eng.generate_tokens(p, params=SamplingParams(**params))
            singles[tuple(p)] = (r.tokens, longest(eng))
    for chunk in (1, 7, 512):
        with engine(tmp_path, wide_model_dir, chunk=chunk, name=f"batch{chunk}") as eng:
            notices = []
            eng.events.subscribe(lambda e: notices.append(e) if e.get("type") == "notice" else None)
            off = [r.tokens for r in eng.generate_batch(prompts, use_cache=False, **params)]
            eng.generate_tokens(DOC[:30], max_tokens=1)  # the shared full-precision prefix
            rows = eng.generate_batch(prompts, **params)
            assert {r.stats["batch_mode"] for r in rows} == {"shared-prefix"} and not notices, notices
            assert all(r.stats["cached_tokens"] >= 30 for r in rows)
            assert [r.tokens for r in rows] == off == [singles[tuple(p)][0] for p in prompts], chunk
            for p, r in zip(prompts, rows):
                state = eng.cache.get_exact(p + r.tokens[:-1], eng.models.get("q").namespace).checkpoint
                alone = singles[tuple(p)][1]
                crossed = len(state.tokens) >= START
                assert state.min_reusable_offset == (START if crossed else 0)
                assert {l.kind for l in state.layers} == {"QuantizedKVCache" if crossed else "KVCache"}
                # the numbers of the row alone, up to float32 roundings of another row count (which
                # now and then cross a quantization step: 0.02-0.3% of the values here); a conversion
                # at the end of the forward instead moves 3-7% of them, by up to 3.6
                diffs = [np.abs(a - b) > 1e-3 for a, b in zip(_kv(state), _kv(alone))]
                assert sum(x.sum() for x in diffs) / sum(x.size for x in diffs) < 0.005, (chunk, p)
            warm = eng.generate_batch(prompts, **params)  # every row from its own cached states
            assert [r.tokens for r in warm] == off
            assert [r.stats["cached_tokens"] for r in warm] == [len(p) - 1 for p in prompts]


def test_bad_kv_start_is_a_clear_error(wide_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "bad", ssd=False) as eng:
        with pytest.raises(ModelError, match="needs kv_bits"):
            eng.load_model(wide_model_dir, kv_start=100)
        with pytest.raises(ModelError, match=">= 0"):
            eng.load_model(wide_model_dir, kv_bits=8, kv_group_size=32, kv_start=-1)
        with pytest.raises(ModelError, match=">= 0"):
            eng.load_model(wide_model_dir, kv_bits=8, kv_group_size=32, kv_start=1.5)
        assert eng.load_model(wide_model_dir, kv_bits=8, kv_group_size=32)["kv_start"] == 5000  # mlx-lm's default
        for start in (0, 40):  # head_dim 32 cannot quantize in groups of 64: said at load, not mid-generation
            with pytest.raises(ModelError, match="kv_group_size=64 does not fit this model's KV"):
                eng.load_model(wide_model_dir, name="g64", kv_bits=8, kv_group_size=64, kv_start=start)
        assert eng.load_model(wide_model_dir, name="f")["kv_start"] is None


def test_the_minimum_reusable_offset_rides_the_remote_tier(server, wide_model_dir, tmp_path):
    """Another machine (its own cache directory, the same Redis/Valkey): a state converted at the start
    goes remote with its offset, and serves a prompt that continues it (the next chat turn: its full
    blocks) with the cold run's tokens; a prompt shorter than the start never takes it."""
    from remote_fixtures import PW, SECRET

    url = server.url(password=PW)
    doc = ids(300, 12)  # (a remote fetch is tried from 256 tokens on)
    with engine(tmp_path, wide_model_dir, name="a", remote_url=url, remote_secret=SECRET) as a:
        first = a.generate_tokens(doc, params=GREEDY)
        assert a.flush()["remote_failed"] == [] and a.stats()["remote_published"] >= 1
    turn = doc + first.tokens + ids(9, 13)  # continues the state a published (its prompt and answer)
    want = cold(tmp_path, wide_model_dir, turn, GREEDY)
    with engine(tmp_path, wide_model_dir, name="b", remote_url=url, remote_secret=SECRET) as b:
        r = b.generate_tokens(turn, params=GREEDY)
        assert r.stats["cache_source"] == "remote" and r.stats["cached_tokens"] == (len(doc) + len(first.tokens)) // 32 * 32
        assert r.tokens == want
        assert [e.checkpoint.min_reusable_offset for e in b.cache.entries()] == [START] * len(b.cache.entries())
    short = doc[:START - 5] + ids(8, 2)
    with engine(tmp_path, wide_model_dir, name="c", remote_url=url, remote_secret=SECRET) as c:
        r = c.generate_tokens(short, params=GREEDY)
        assert r.stats["cached_tokens"] == 0 and r.tokens == cold(tmp_path, wide_model_dir, short, GREEDY)


def test_long_forwards_attend_over_the_quantized_kv_dequantized(wide_model_dir, tmp_path):
    """Many queries over quantized KV (a prefill chunk past the start) attend over it dequantized with
    MLX's fused attention (faster on a CPU); the numbers are mlx-lm's quantized attention's to float32
    rounding, and a cold run, any chunking and a hit still agree."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from mlxcache_kernel.engine.kv.quantize_start import MIN_DEQUANTIZED_QUERIES, dequantized_attention

    class Quantized:  # what the attention asks of a cache
        bits, group_size = 8, 32

    def queries(n):  # a fresh array for each call (mlx-lm's quantized attention scales its queries in place)
        return mx.random.normal((1, 4, n, 32), key=mx.random.key(1))

    k, v = (mx.quantize(mx.random.normal((1, 2, 300, 32), key=mx.random.key(s)), group_size=32, bits=8) for s in (2, 3))
    mlx_lm = lambda q: quantized_scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal", group_size=32, bits=8)
    n = MIN_DEQUANTIZED_QUERIES
    got = dequantized_attention(queries(n), k, v, Quantized(), 0.2, "causal")
    assert 0 < mx.abs(got - mlx_lm(queries(n))).max().item() < 1e-4  # (another path: roundings differ)
    few = dequantized_attention(queries(8), k, v, Quantized(), 0.2, "causal")  # few queries: mlx-lm's own
    assert mx.array_equal(few, mlx_lm(queries(8))).item()
    long_doc = ids(400, 21)  # forwards of up to 360 tokens past the start
    runs = {chunk: cold(tmp_path, wide_model_dir, long_doc, GREEDY, chunk) for chunk in (7, 100, 512)}
    assert runs[7] == runs[100] == runs[512], runs
    with engine(tmp_path, wide_model_dir, name="long") as eng:
        eng.generate_tokens(long_doc[:120], max_tokens=1)  # quantized, from 40
        r = eng.generate_tokens(long_doc, params=GREEDY)  # a hit, then 280 tokens in one forward
        assert r.stats["cached_tokens"] >= 119 and r.tokens == runs[512]


def test_another_question_over_a_quantized_document_is_served_remotely(server, wide_model_dir, tmp_path):
    """A state converted at the start goes remote as a converted chain (its full blocks from token 0,
    the offset in its signed layout), beside the full-precision chain of the same prefix keys. Another
    machine asking another question over the document takes the document's full blocks, with the
    cold run's tokens, greedy and seeded; a prompt leaving the document before the start never takes
    them, and takes the document's full-precision blocks instead; after a removal the converted
    chain is a miss too."""
    from remote_fixtures import PW, SECRET

    from mlxcache_kernel.engine.cache.remote import RemoteTier

    start, url = 300, server.url(password=PW)  # past the 256 tokens a remote fetch is tried from
    doc = ids(400, 14)
    with engine(tmp_path, wide_model_dir, start=start, name="a", remote_url=url, remote_secret=SECRET) as a:
        a.generate_tokens(doc + ids(20, 15), params=GREEDY)
        assert a.flush()["remote_failed"] == [] and a.stats()["remote_published"] >= 1
        ns = max(a.cache.entries(), key=lambda e: len(e.tokens)).ns
    published = set(server.client().keys("*:crec:*"))
    assert len(published) == (len(doc) + 20) // 32  # the converted chain, one record per full block
    for i, params in enumerate((GREEDY, SEEDED)):
        prompt = doc + ids(12, 16 + i)
        with engine(tmp_path, wide_model_dir, start=start, name=f"b{i}", remote_url=url, remote_secret=SECRET) as b:
            if i == 0:  # what the lookup rebuilds carries the offset of its signed layout
                cp = b.cache.remote.lookup(prompt, ns, 0)
                assert (len(cp), cp.min_reusable_offset) == (len(doc) // 32 * 32, start)
            r = b.generate_tokens(prompt, params=params)
            assert r.stats["cache_source"] == "remote" and r.stats["remote_tokens"] == len(doc) // 32 * 32
            assert r.tokens == cold(tmp_path, wide_model_dir, prompt, params, start=start)
            assert [e.checkpoint.min_reusable_offset for e in b.cache.entries()] == [start] * len(b.cache.entries())
    left = doc[:start - 10] + ids(60, 17)  # shares 9 converted blocks (288 tokens), fewer than the start
    with engine(tmp_path, wide_model_dir, start=start, name="b0", prefetch_budget_bytes=0) as again:
        r = again.generate_tokens(left, params=GREEDY)  # the remote state written through kept its offset
        assert r.stats["cached_tokens"] == 0 and r.tokens == cold(tmp_path, wide_model_dir, left, GREEDY, start=start)
    with engine(tmp_path, wide_model_dir, start=start, name="f", remote_url=url, remote_secret=SECRET) as f:
        f.generate_tokens(doc[:285], params=GREEDY)  # 297 tokens, never converted: 8 full-precision blocks of the doc
        assert f.flush()["remote_failed"] == []
    with engine(tmp_path, wide_model_dir, start=start, name="c", remote_url=url, remote_secret=SECRET) as c:
        r = c.generate_tokens(left, params=GREEDY)  # takes the shorter full-precision run
        assert r.stats["cache_source"] == "remote" and r.stats["remote_tokens"] == 8 * 32
        assert r.tokens == cold(tmp_path, wide_model_dir, left, GREEDY, start=start)
        assert min(e.checkpoint.min_reusable_offset for e in c.cache.entries()) == 0  # the 256 tokens adopted
    with RemoteTier(url, secret=SECRET) as t:
        assert t.remove(ns, doc + ids(20, 15), 32) > 0
    assert not published & set(server.client().keys("*:crec:*"))
    with engine(tmp_path, wide_model_dir, start=start, name="d", remote_url=url, remote_secret=SECRET) as d:
        r = d.generate_tokens(doc + ids(12, 16), params=GREEDY)
        assert r.stats["cache_source"] != "remote"


def test_a_converted_run_cut_below_its_start_is_a_miss_without_a_read(server, wide_model_dir, tmp_path):
    """Bad members against the converted chain. An unlisted writer's records after a listed writer's cut
    the run a reader can trust to below the start: it is not read, and the document's full-precision
    run is served as if the converted chain were not there. A block before
    the start gone from the server (evicted) leaves a shorter verified run: a miss, not a quantized
    state shorter than its own start. Both cells keep the cold run's tokens."""
    from remote_fixtures import PW, SECRET

    from mlxcache_kernel.engine.cache.remote.keys import KeySpace, team_keys
    from mlxcache_kernel.engine.cache.remote.writers import SigningKey

    alice, mallory = SigningKey.generate(), SigningKey.generate()
    start, url, doc = 300, server.url(password=PW), ids(400, 18)
    listed = f"alice={alice.public_text()}"

    def member(name, key):
        return engine(tmp_path, wide_model_dir, start=start, name=name, remote_url=url, remote_secret=SECRET,
                      remote_signing_key=key, remote_writers=listed)

    with member("m", mallory) as m:  # the whole document, under an unlisted key
        m.generate_tokens(doc + ids(20, 19), params=GREEDY)
        assert m.flush()["remote_failed"] == []
    with member("a", alice) as a:  # re-signs the document's first 9 blocks (its prompt leaves it at 300)
        a.generate_tokens(doc[:start] + ids(20, 20), params=GREEDY)
        assert a.flush()["remote_failed"] == []
    with member("f", alice) as f:  # 297 tokens, never converted: 8 full-precision blocks of the document
        f.generate_tokens(doc[:285], params=GREEDY)
        assert f.flush()["remote_failed"] == []
    prompt = doc + ids(12, 21)
    want = cold(tmp_path, wide_model_dir, prompt, GREEDY, start=start)
    with member("r", None) as r:  # the converted run is cut below the start; the plain run still serves
        got = r.generate_tokens(prompt, params=GREEDY)
        s = r.stats()
        assert got.stats["cache_source"] == "remote" and got.stats["remote_tokens"] == 8 * 32
        assert got.tokens == want and s["remote_unknown_writer"] >= 3

    doc2 = ids(400, 23)  # another document (one a2 takes nothing of from the remote, so it publishes it)
    with member("a2", alice) as a:  # the whole document, listed; then a block before the start goes
        a.generate_tokens(doc2 + ids(20, 22), params=GREEDY)
        assert a.flush()["remote_failed"] == []
        ns, tokens = a.last_key
        info = a.cache.store.file_info(ns, tokens)
    gone, = [b for b in info.header.blocks if b.start == 5 * 32]
    assert server.client().delete(KeySpace(team_keys(SECRET)[0]).block(gone.name)) == 1
    prompt = doc2 + ids(12, 21)
    with member("r2", None) as r:
        got = r.generate_tokens(prompt, params=GREEDY)
        assert got.stats["cached_tokens"] == 0 and got.tokens == cold(tmp_path, wide_model_dir, prompt, GREEDY,
                                                                       start=start)
        assert r.stats()["remote_bytes_read"] > 0  # the 5 blocks before the gap were read, and not used
