"""Property: for JSON Schemas drawn by hypothesis (nested objects and arrays, enums, numbers with bounds,
optional fields, string patterns and lengths), every answer of a tiny random model (arbitrary tokens:
what a constraint must survive) completes, parses and validates, greedy and seeded, alone and as rows
of one batch that mixes the schemas; and a batch row answers as the same prompt alone."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tiny_model import build_tiny_model

from mlxcache_kernel.engine import Engine

PROMPT = "Fill in the record."
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True)
PATTERNS = [r"^[a-z]{1,4}$", r"^[0-9]{2}-[0-9]{2}$", r"^(red|green|blue)$", r"^[A-Z][a-z]{0,3}$"]


def _bounded(lo: int, span: int, kind: str) -> dict:
    return {"type": kind, "minimum": lo, "maximum": lo + span}


LEAVES = st.one_of(
    st.builds(_bounded, st.integers(-1000, 1000), st.integers(0, 500), st.just("integer")),
    st.builds(_bounded, st.integers(-10, 10), st.integers(1, 20), st.just("number")),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.one_of(NAMES, st.integers(-5, 5), st.booleans(), st.none()),
                                                min_size=1, max_size=4, unique=True)),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
)


def _objects(values, at_least: int = 0):
    """Objects of 1-3 drawn properties, each required or optional (at least `at_least` required)."""
    def with_required(props: dict):
        names = sorted(props)
        return st.sets(st.sampled_from(names), min_size=min(at_least, len(names))).map(
            lambda required: {"type": "object", "properties": props, "required": [n for n in names if n in required],
                              "additionalProperties": False})
    return st.dictionaries(NAMES, values, min_size=1, max_size=3).flatmap(with_required)


def _containers(children):
    return st.one_of(
        st.builds(lambda item, lo, extra: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + extra},
                  children, st.integers(0, 2), st.integers(0, 2)),
        _objects(children),
    )


SCHEMAS = _objects(st.recursive(LEAVES, _containers, max_leaves=6), at_least=1).map(
    lambda schema: {**schema, "x-guidance": {"whitespace_flexible": False}})
SAMPLING = st.one_of(st.just({}), st.builds(lambda s: {"temperature": 0.9, "seed": s}, st.integers(0, 1000)))
MAX_TOKENS = 1200  # more than any answer these bounded schemas allow, at up to 4 tokens a character


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    root = tmp_path_factory.mktemp("properties")
    with Engine(cache_dir=root / "c", ssd=False) as e:
        e.load_model(build_tiny_model(root / "m"), name="m")
        yield e


def _valid(r, schema) -> None:
    assert r.stats["finish_reason"] == "eos" and r.stats["constraint_incomplete"] is None, (schema, r.text)
    assert r.parsed == json.loads(r.text)
    jsonschema.validate(r.parsed, schema)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=SCHEMAS, sampling=SAMPLING)
def test_every_answer_parses_and_validates(eng, schema, sampling):
    _valid(eng.generate(PROMPT, max_tokens=MAX_TOKENS, use_cache=False, response_format=schema, **sampling), schema)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schemas=st.lists(SCHEMAS, min_size=2, max_size=4), sampling=SAMPLING)
def test_batch_rows_of_different_schemas_parse_and_answer_as_alone(eng, schemas, sampling):
    prompts = [f"{PROMPT} Row {i}." for i in range(len(schemas))]
    rows = eng.generate_batch(prompts, max_tokens=MAX_TOKENS, use_cache=False, response_format=schemas, **sampling)
    for r, schema in zip(rows, schemas):
        _valid(r, schema)
    seed = sampling.get("seed", 0)
    alone = [eng.generate(p, max_tokens=MAX_TOKENS, use_cache=False, response_format=s, **{**sampling, "seed": seed + i})
             for i, (p, s) in enumerate(zip(prompts, schemas))]
    assert [a.tokens for a in alone] == [r.tokens for r in rows]
