"""Passages on the tiers: each passage's KV is an object on RAM, SSD (a restart reads it back, verified)
and the team tier (another machine fetches it), and what comes back places exactly as what was
encoded. The placed state is never an exact prefix: only the template's head is published, a plain
prompt over the same text never hits approximate state, an interrupted run publishes nothing; and
the exact prefix cache still serves what it holds, before (the head) and through the passages."""

from __future__ import annotations

import pytest

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.generate.passages.prompt import passage_prompt

PASSAGES = ["The harbour master counted forty ships before the storm came in from the west.",
            "Mountains north of the river hold snow until late June, feeding the mills below.",
            "A lighthouse keeper wrote every night: wind, ships seen, oil burned, and the tides."]
QUESTION = "Which ships are mentioned?"
SYSTEM = "You answer from the passages."
KW = dict(system=SYSTEM, recompute=0.3, max_tokens=8)


def joined(passages, question=QUESTION) -> str:
    return "\n\n".join(passages) + "\n\n" + question


def test_passages_come_back_from_ssd_after_a_restart_and_place_the_same(tiny_model_dir, tmp_path):
    order = PASSAGES[::-1]
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as a:
        a.load_model(str(tiny_model_dir), name="m")
        first = a.generate(QUESTION, passages=PASSAGES, **KW)
        assert first.stats["passage_sources"] == ["encoded"] * 3 and first.stats["passages_reused"] == 0
        again = a.generate(QUESTION, passages=order, **KW)
        assert again.stats["passage_sources"] == ["ram"] * 3 and again.stats["passages_encoded"] == 0
        labels = [r["label"] for r in a.admin.entries() if r["kind"] == "object"]
        assert labels.count("passage") == 3
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as b:
        b.load_model(str(tiny_model_dir), name="m")
        restored = b.generate(QUESTION, passages=order, **KW)
        assert restored.stats["passage_sources"] == ["ssd"] * 3 and restored.stats["passages_encoded"] == 0
        assert restored.tokens == again.tokens
        assert b.stats()["object_ssd_hits"] == 3
        cold = b.generate(QUESTION, passages=order, use_cache=False, **KW)  # encoded again, stored nowhere
        assert cold.stats["passage_sources"] == ["encoded"] * 3 and cold.tokens == again.tokens


def test_another_machine_fetches_passages_from_the_team_tier(tiny_model_dir, tmp_path):
    from redis_servers import RedisServer, missing

    if missing():
        pytest.skip(missing())
    server = RedisServer(tmp_path / "redis", password="passage-pw-1234").start()
    try:
        kw = dict(remote_url=server.url(password="passage-pw-1234"), remote_secret="passage-team-secret-0123",
                  prefetch_budget_bytes=0)
        with Engine(cache_dir=tmp_path / "a", **kw) as a:
            a.load_model(str(tiny_model_dir), name="m")
            a.generate(QUESTION, passages=PASSAGES, **KW)
            assert a.flush()["remote_failed"] == []
        with Engine(cache_dir=tmp_path / "b", **kw) as b:
            b.load_model(str(tiny_model_dir), name="m")
            fetched = b.generate(QUESTION, passages=PASSAGES[::-1], **KW)
            assert fetched.stats["passage_sources"] == ["remote"] * 3
            cold = b.generate(QUESTION, passages=PASSAGES[::-1], use_cache=False, **KW)
            assert fetched.tokens == cold.tokens
    finally:
        server.stop()


def test_the_placed_state_is_never_an_exact_prefix(tiny_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(str(tiny_model_dir), name="m")
        m = eng.models.get("m")
        pp = passage_prompt(m.tokenizer, QUESTION, PASSAGES, system=SYSTEM)
        head = pp.spans[0][0]
        r = eng.generate(QUESTION, passages=PASSAGES, **KW)
        assert r.stats["cached_tokens"] == 0 and r.stats["prefilled_tokens"] == len(pp.tokens) - pp.spans[-1][1] + head
        prefixes = [e for e in eng.admin.entries() if e["kind"] != "object"]
        assert [p["tokens"] for p in prefixes] == [head]  # the exact head, nothing longer
        plain = eng.generate(joined(PASSAGES), system=SYSTEM, max_tokens=8)
        assert plain.stats["cached_tokens"] == head  # the head only: never the placed passages
        assert plain.tokens == eng.generate(joined(PASSAGES), system=SYSTEM, max_tokens=8, use_cache=False).tokens

        def interrupt(_text):
            raise KeyboardInterrupt

        before = len([e for e in eng.admin.entries() if e["kind"] != "object"])
        with pytest.raises(KeyboardInterrupt):
            eng.generate("Another question?", passages=PASSAGES[::-1], on_text=interrupt, **KW)
        assert len([e for e in eng.admin.entries() if e["kind"] != "object"]) == before  # nothing published


def test_the_exact_cache_serves_the_head_and_whatever_it_holds_through_the_passages(tiny_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(str(tiny_model_dir), name="m")
        m = eng.models.get("m")
        pp = passage_prompt(m.tokenizer, QUESTION, PASSAGES, system=SYSTEM)
        head, end = pp.spans[0][0], pp.spans[-1][1]
        eng.generate("First question?", passages=PASSAGES, **KW)
        second = eng.generate(QUESTION, passages=PASSAGES[::-1], **KW)
        assert second.stats["cached_tokens"] == head and second.stats["cache_source"] == "ram"
        assert second.stats["prefilled_tokens"] == len(pp.tokens) - end  # only the question
        exact = eng.generate(joined(PASSAGES), system=SYSTEM, max_tokens=8)  # a plain prompt: published exact
        through = eng.generate(QUESTION, passages=PASSAGES, **KW)
        assert through.stats["cached_tokens"] >= end and through.stats["approximate"] is False
        assert through.stats["passage_tokens_exact"] == end - head and through.tokens == exact.tokens
