"""The Engine facade: the parts a user reaches are objects with methods of their own (eng.models,
eng.sessions, eng.checkpoints, eng.kv, eng.admin, eng.objects, eng.events); the facade's own methods
coordinate several parts; the names the design promises stay as one-line delegations; sampling
options are taken one way."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from mlxcache_kernel.engine import Engine, SamplingParams

# The design's public surface: scripts, notebooks and outside checks call these on Engine.
COMPATIBILITY = {"checkpoint_save": "checkpoints.save", "checkpoint_restore": "checkpoints.restore",
                 "checkpoint_list": "checkpoints.list", "cache_clear": "admin.clear", "cache_gc": "admin.gc",
                 "cache_verify": "admin.verify"}
FACADE = {"load_model", "encode_prompt", "generate", "generate_tokens", "generate_batch", "score", "score_groups",
          "poll", "flush", "stats", "close"}
PARTS = {"models", "sessions", "checkpoints", "kv", "admin", "objects", "events"}
DATA = {"config", "cache_dir", "last_result", "last_key", "vision_counters", "prefill_chunk", "closed"}
INTERNALS = {"cache", "memory", "metrics"}  # the tiered cache, the memory guard, the counters: for tests and tools
PROMPT = "Tell me about the sea and the ships on it."


@pytest.fixture
def eng(tiny_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as e:
        e.load_model(tiny_model_dir, name="m")
        yield e


def test_the_public_surface_is_the_facade_its_parts_and_the_compatibility_block(eng):
    methods = {n for n, v in vars(Engine).items() if not n.startswith("_") and inspect.isfunction(v)}
    assert methods == FACADE | set(COMPATIBILITY)
    properties = {n for n, v in vars(Engine).items() if isinstance(v, property)}
    assert {n for n in vars(eng) if not n.startswith("_")} | properties == PARTS | DATA | INTERNALS


@pytest.mark.parametrize("name", sorted(COMPATIBILITY))
def test_each_compatibility_name_is_one_delegation_to_its_part(name):
    fn = ast.parse(textwrap.dedent(inspect.getsource(getattr(Engine, name)))).body[0]
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call)
    assert ast.unparse(body[0].value.func) == f"self.{COMPATIBILITY[name]}"


def test_compatibility_names_answer_as_their_parts(eng):
    eng.generate(PROMPT, max_tokens=4, session="s")
    saved = eng.checkpoint_save("intro", session="s")
    assert saved["name"] == "intro" and eng.checkpoint_list() == eng.checkpoints.list() == [saved]
    assert eng.checkpoint_restore("intro")["source"] == "ram"
    assert eng.cache_verify() == eng.admin.verify() == []
    assert eng.cache_gc(dry_run=True) == eng.admin.gc(dry_run=True)
    assert eng.cache_clear()["ram_entries"] >= 1 and {r["tier"] for r in eng.admin.entries()} == {"ssd"}


def test_closed_is_public_and_a_closed_engine_refuses_work(tiny_model_dir, tmp_path):
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(tiny_model_dir, name="m")
    assert eng.closed is False
    assert eng.close() is not None and eng.closed is True
    assert eng.close() is None  # once
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate(PROMPT, max_tokens=2)
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate_tokens([1, 2, 3], max_tokens=2)
    with pytest.raises(AttributeError):
        eng.closed = False  # read-only


def test_generate_tokens_takes_the_sampling_options_of_generate(eng):
    kw = dict(max_tokens=6, temperature=0.8, top_k=20, seed=3)
    tokens = eng.encode_prompt(PROMPT)
    by_keywords = eng.generate_tokens(tokens, use_cache=False, **kw)
    by_params = eng.generate_tokens(tokens, params=SamplingParams(**kw), use_cache=False)
    assert by_keywords.tokens == by_params.tokens == eng.generate(PROMPT, use_cache=False, **kw).tokens
    assert eng.generate(PROMPT, params=SamplingParams(**kw), use_cache=False).tokens == by_keywords.tokens


def test_sampling_options_one_way_with_clear_errors(eng):
    tokens = eng.encode_prompt(PROMPT)
    with pytest.raises(TypeError, match=r"params= or the sampling options \(max_tokens\), not both"):
        eng.generate_tokens(tokens, params=SamplingParams(max_tokens=2), max_tokens=3)
    with pytest.raises(TypeError, match=r"params= or the sampling options \(seed\), not both"):
        eng.generate(PROMPT, params=SamplingParams(max_tokens=2), seed=1)
    with pytest.raises(TypeError, match="params must be a SamplingParams, got dict"):
        eng.generate_tokens(tokens, params={"max_tokens": 2})
    with pytest.raises(TypeError, match=r"unknown option\(s\) max_token; the sampling options are max_tokens, "
                                        r"temperature.*; the others checkpoint_every, choices, draft, grammar"):
        eng.generate_tokens(tokens, max_token=2)
    with pytest.raises(TypeError, match=r"unknown option\(s\) tempreature; the sampling options are max_tokens"):
        eng.generate(PROMPT, tempreature=0.5)
    with pytest.raises(TypeError, match="positional"):
        eng.generate_tokens(tokens, SamplingParams(max_tokens=2))  # keywords only
    assert eng.stats()["sessions"] == 0 and eng.admin.entries() == []  # refused before any work


def test_sessions_close_forgets_the_chat_and_the_caches_references(eng):
    first = eng.generate(PROMPT, max_tokens=4, session="s")
    assert [r["sessions"] for r in eng.admin.entries()] == [["s"]]
    eng.sessions.close("s")
    assert "s" not in eng.sessions and [r["sessions"] for r in eng.admin.entries()] == [[]]
    again = eng.generate(PROMPT, max_tokens=4)  # the state stays cached: a new conversation hits it
    assert again.stats["cache_source"] == "ram" and again.tokens == first.tokens
    assert eng.sessions.switch(eng.sessions.new("t").id) == {"session": "t", "tokens": 0, "source": None}


def test_models_part_info_and_unload(eng, tiny_model_dir):
    events = []
    eng.events.subscribe(events.append)
    info = eng.load_model(tiny_model_dir, name="second")
    assert {k: v for k, v in info.items() if k != "prefetch"} == eng.models.info("second")
    assert eng.models.info()["name"] == "m" == eng.models.default
    eng.models.unload("second")
    assert [e["name"] for e in events if e["type"] == "model_unloaded"] == ["second"]
    assert eng.models.names() == ["m"]
