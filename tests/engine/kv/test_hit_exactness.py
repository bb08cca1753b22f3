"""After a hit, as exact as a cold run (issue 28): every family, float32 and bfloat16, greedy and
seeded, reruns that write nothing, and mlx-lm itself untouched by the engine.

The natural floor of "exact": any reuse moves where prefill chunks start, and two cold runs with
different prefill chunks differ by rounding. A hit may differ from a cold run no more than that.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from tiny_archs import FAMILIES, build_arch_model

from mlxcache_kernel.engine import Engine, SamplingParams
from mlxcache_kernel.engine.generate.prefill import prefill


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


DOC = ids(700, 3)  # longer than a prefill chunk: chunk boundaries matter
QUESTIONS = [ids(9 + i, 40 + i) for i in range(3)]
WINDOWED = ("gemma3_text", "gpt_oss")  # sliding windows (32) wrap inside DOC: exact boundaries only


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {a: build_arch_model(a, root / a) for a in ("llama", "gemma3_text", "gpt_oss", "qwen3_next", *FAMILIES)}


def _engine(path, model_dir, **kw) -> Engine:
    eng = Engine(cache_dir=path, **kw)
    eng.load_model(model_dir)
    return eng


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text", "gpt_oss", "qwen3_next", "deepseek_v3", "gemma2"])
def test_every_family_continues_a_hit_as_a_cold_run(arch, family_dirs, tmp_path):
    """A second question over a cached document (where the family can cut back) and a rerun:
    greedy and seeded tokens equal a cold run, in RAM and from SSD in a new engine; %model says
    what a hit copies."""
    prompts = [DOC + q for q in QUESTIONS[:2]]
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.9, seed=5)]
    with _engine(tmp_path / "cold", family_dirs[arch], ssd=False) as cold_eng:
        cold = [[cold_eng.generate_tokens(p, params=sp, use_cache=False).tokens for sp in params] for p in prompts]
    with _engine(tmp_path / "c", family_dirs[arch]) as eng:
        info = eng.models.info()
        assert info["cache_hit"] and all(isinstance(v, str) for v in info["cache_hit"].values())
        if "KVCache" in info["cache_hit"]:
            assert "copied once" in info["cache_hit"]["KVCache"]
        for p, want in zip(prompts, cold):
            for sp, w in zip(params, want):
                assert eng.generate_tokens(p, params=sp).tokens == w  # the first prompt cold, the second over DOC
                rerun = eng.generate_tokens(p, params=sp)
                assert rerun.stats["cache_source"] == "ram" and rerun.tokens == w
        second = eng.generate_tokens(prompts[1], params=params[0])
        if arch not in WINDOWED:
            assert second.stats["cached_tokens"] >= len(DOC)
        eng.flush()
    with _engine(tmp_path / "c", family_dirs[arch], prefetch_budget_bytes=0) as fresh:  # from SSD
        for p, want in zip(prompts, cold):
            r = fresh.generate_tokens(p, params=params[0])
            assert r.stats["cache_source"] in ("ssd", "ram") and r.tokens == want[0]


def _next_logits(model, caches, tokens, chunk):
    """Prefill all but the last token in chunks, then the logits after the last one."""
    prefill(model, caches, tokens[:-1], chunk=chunk)
    out = model(mx.array(tokens[-1:])[None], cache=caches)[0, -1].astype(mx.float32)
    mx.eval(out)
    return np.array(out)


def test_hit_logits_are_within_the_rounding_of_another_prefill_chunk(family_dirs, tmp_path):
    model_dir = family_dirs["llama"]
    prompt = DOC + QUESTIONS[2]
    with _engine(tmp_path / "c", model_dir, ssd=False) as eng:
        m = eng.models.get()
        cold = {chunk: _next_logits(m.model, m.new_caches(), prompt, chunk) for chunk in (512, 256, 100)}
        noise = max(float(np.abs(cold[512] - cold[c]).max()) for c in (256, 100))
        eng.generate_tokens(DOC + QUESTIONS[0], max_tokens=4)
        loan = eng.cache.take(prompt, m.namespace)
        assert loan.length == len(DOC)
        hit = _next_logits(m.model, loan.caches, prompt[loan.length:], 512)
        loan.release()
    scale = float(np.abs(cold[512]).max())
    assert float(np.abs(hit - cold[512]).max()) <= max(noise, 1e-6 * scale), (noise, scale)


def _bf16_model(src, dst):
    """The tiny llama converted to bfloat16 with mlx-lm's own converter."""
    from mlx_lm import convert

    convert(str(src), mlx_path=str(dst), dtype="bfloat16")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists() and not (dst / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def test_a_bf16_model_after_a_hit_equals_cold_as_other_prefill_chunks_do(family_dirs, tmp_path):
    """bfloat16 with mlx-lm's converter: seeded and greedy runs after a rerun hit and after a
    different-question hit equal cold runs, exactly as cold runs with other prefill chunks do."""
    model_dir = _bf16_model(family_dirs["llama"], tmp_path / "bf16")
    assert json.loads((model_dir / "config.json").read_text()).get("torch_dtype", "bfloat16") == "bfloat16"
    prompts = [DOC + q for q in QUESTIONS]
    params = [SamplingParams(max_tokens=16, temperature=0.9, seed=s) for s in range(4)] + [SamplingParams(max_tokens=16)]
    chunked = {}
    for chunk in (512, 256, 128):
        with _engine(tmp_path / f"cold{chunk}", model_dir, ssd=False, prefill_chunk=chunk) as cold_eng:
            assert "bfloat16" in cold_eng.models.info()["kv_scheme"]
            chunked[chunk] = [[cold_eng.generate_tokens(p, params=sp, use_cache=False).tokens for sp in params]
                              for p in prompts]
    chunks_agree = chunked[512] == chunked[256] == chunked[128]
    with _engine(tmp_path / "warm", model_dir, ssd=False) as eng:
        got = []
        for p in prompts:  # the first cold, the others over the cached DOC; each then rerun
            row = [eng.generate_tokens(p, params=sp).tokens for sp in params]
            assert [eng.generate_tokens(p, params=sp).tokens for sp in params] == row  # reruns
            got.append(row)
    diverged = sum(a != b for ra, rb in zip(got, chunked[512]) for a, b in zip(ra, rb))
    chunk_diverged = sum(a != b for ra, rb in zip(chunked[256], chunked[512]) for a, b in zip(ra, rb))
    assert diverged <= chunk_diverged and (not chunks_agree or got == chunked[512])


def test_a_rerun_writes_nothing_and_a_second_question_only_its_own(family_dirs, tmp_path):
    model_dir = family_dirs["llama"]
    with _engine(tmp_path / "c", model_dir) as eng:
        first = eng.generate_tokens(DOC + QUESTIONS[0], max_tokens=12)
        eng.flush()
        written = eng.stats()["bytes_written"]
        again = eng.generate_tokens(DOC + QUESTIONS[0], max_tokens=12)
        eng.flush()
        assert again.tokens == first.tokens and again.stats["cache_source"] == "ram"
        assert eng.stats()["bytes_written"] == written  # the same tokens: nothing written again
        eng.generate_tokens(DOC + QUESTIONS[1], max_tokens=12)
        eng.flush()
        assert 0 < eng.stats()["bytes_written"] - written < written / 4  # its own blocks, not the document
    with _engine(tmp_path / "c", model_dir, prefetch_budget_bytes=0) as fresh:  # after a restart, from SSD
        r = fresh.generate_tokens(DOC + QUESTIONS[0], max_tokens=12)
        fresh.flush()
        assert r.stats["cache_source"] == "ssd" and r.tokens == first.tokens
        assert fresh.stats()["bytes_written"] == 0


def test_plain_mlx_lm_beside_the_engine_is_mlx_lm(family_dirs, tmp_path):
    """The engine installs nothing into mlx-lm: its attention entry point is its own, and a plain
    mlx-lm forward gives the same bits before and after an engine served the same model."""
    from mlx_lm import load
    from mlx_lm.models import base, llama
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(family_dirs["llama"]))

    def plain():
        out = model(mx.array(DOC[:200])[None], cache=make_prompt_cache(model))
        mx.eval(out)
        return np.array(out)

    before = plain()
    with _engine(tmp_path / "c", family_dirs["llama"], ssd=False) as eng:
        eng.generate_tokens(DOC[:200] + QUESTIONS[0], max_tokens=4)
        eng.generate_tokens(DOC[:200] + QUESTIONS[1], max_tokens=4)
        during = plain()
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert base.scaled_dot_product_attention.__module__ == "mlx_lm.models.base"
    assert np.array_equal(before, during) and np.array_equal(before, plain())


def test_a_state_of_tokens_already_on_ssd_is_not_written_again(family_dirs, tmp_path):
    """The writer's rule behind "a rerun writes nothing" even where a rerun's KV differs by rounding
    (another prefill chunk): a checkpoint whose exact tokens are committed is not written again."""
    from mlxcache_kernel.engine.kv.checkpoint import Checkpoint

    with _engine(tmp_path / "c", family_dirs["llama"]) as eng:
        m = eng.models.get()
        tokens = DOC + QUESTIONS[0]
        eng.generate_tokens(tokens, max_tokens=1)
        eng.flush()
        stored = max(eng.cache.store.entries(), key=len)
        written, skipped = eng.stats()["bytes_written"], eng.stats()["writes_skipped_stored"]
        caches = m.new_caches()
        prefill(m.model, caches, list(stored.tokens), chunk=100)  # the same tokens, other rounding
        eng.cache.put(Checkpoint.capture(stored.tokens, caches), m.namespace)
        eng.flush()
        assert eng.stats()["bytes_written"] == written and eng.stats()["writes_skipped_stored"] == skipped + 1
        assert eng.cache.get_exact(stored.tokens, m.namespace).write_state == "committed"
