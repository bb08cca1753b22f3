"""Checkpoints read back from SSD that share blocks share buffers in RAM, as published ones do, and
prefetching counts the bytes they share once (issue 50, bug 2): real files, a tiny random model."""

from __future__ import annotations

import pytest

from mlxcache_kernel.engine import Engine

DOC = "A long shared document about rivers, bridges and the towns beside them. " * 9
QUESTIONS = ["Which rivers?", "How many bridges are there?", "Name the towns.", "Is it long?", "Who wrote it?"]


def ask_all(eng: Engine) -> list:
    return [eng.generate(DOC + "\n\nQuestion: " + q, max_tokens=6, raw=True) for q in QUESTIONS]


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    """A tiny llama with head_dim 32, so KV quantizes in groups of 32."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "wide", hidden=128)


def load(eng: Engine, model_dir, kv_bits) -> dict:
    return eng.load_model(model_dir, name="tiny", **({"kv_bits": kv_bits, "kv_group_size": 32, "kv_start": 0}
                                                     if kv_bits else {}))


@pytest.fixture(params=[None, 8], ids=["plain", "kv8"])
def written(wide_model_dir, tmp_path, request):
    """A cache directory holding the questions' checkpoints; RAM bytes and answers before the restart."""
    eng = Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0)
    load(eng, wide_model_dir, request.param)
    answers = [r.tokens for r in ask_all(eng)]
    before = eng.stats()
    assert before["ram_entries"] == len(QUESTIONS)
    assert eng.close()["failed"] == []
    return tmp_path / "c", before, answers, request.param


def test_restored_questions_over_one_document_hold_it_once(wide_model_dir, written):
    cache, before, answers, kv_bits = written
    eng = Engine(cache_dir=cache, prefetch_budget_bytes=1 << 30)
    info = load(eng, wide_model_dir, kv_bits)
    assert info["prefetch"]["checkpoints"] == len(QUESTIONS)
    assert eng.cache.loading.wait_reads(60)
    after = eng.stats()
    assert after["ram_entries"] == len(QUESTIONS) and after["prefetches_completed"] == len(QUESTIONS)
    assert after["restore_shared_bytes"] > 0
    # each restored copy alone would hold the document again: ~5x; shared, about what was held before
    assert after["ram_used_bytes"] <= 1.25 * before["ram_used_bytes"], (after["ram_used_bytes"],
                                                                        before["ram_used_bytes"])
    again = ask_all(eng)
    assert [r.stats["cache_source"] for r in again] == ["ram"] * len(QUESTIONS)
    assert [r.tokens for r in again] == answers  # the shared buffers hold the same KV
    eng.close()


def test_the_prefetch_budget_counts_shared_blocks_once(wide_model_dir, written):
    cache, before, _, kv_bits = written
    with Engine(cache_dir=cache) as look:
        largest = max(h.raw_bytes for h in look.cache.store.entries())
    eng = Engine(cache_dir=cache, prefetch_budget_bytes=int(1.5 * largest))  # one file and a half, counted whole
    info = load(eng, wide_model_dir, kv_bits)
    assert info["prefetch"]["checkpoints"] == len(QUESTIONS), info["prefetch"]
    assert info["prefetch"]["bytes"] <= int(1.5 * largest)
    assert eng.cache.loading.wait_reads(60)
    assert eng.stats()["ram_entries"] == len(QUESTIONS)
    eng.close()
