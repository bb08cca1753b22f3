"""Constrained answers, one row (generate/constrain.py, generate/grammars.py): JSON Schema, Pydantic,
regex, choices and grammars on a tiny random model (its arbitrary tokens are what a constraint must
survive); plain decoding's tokens wherever the grammar allows them; drafts from a model and from
the context under the grammar; RAM and SSD hits; a chat template's forced opening; the constrained
log-probabilities; one-line errors that lose nothing."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field
from typing import Literal
from tiny_model import CHATML, build_tiny_model

from mlxcache_kernel.engine import ConstraintError, Engine, GenerationError
from mlxcache_kernel.engine.generate import loop
from repo_paths import ROOT

PROMPT = "Give me a record."
COMPACT = {"whitespace_flexible": False}  # llguidance's option: no whitespace between JSON tokens
SCHEMA = {"type": "object", "x-guidance": COMPACT, "additionalProperties": False,
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]},
                         "name": {"type": "string", "maxLength": 4}},
          "required": ["n", "tag", "name"]}
ANY_BYTES = "start: <[3-258]>*"  # every non-special token of the tiny byte-level vocabulary


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"x-guidance": COMPACT})
    n: int = Field(ge=0, le=99)
    tag: Literal["a", "b"]
    name: str = Field(max_length=4)


KINDS = {  # keyword: (value, the check an answer passes)
    "schema": (dict(response_format=SCHEMA), lambda r: jsonschema.validate(r.parsed, SCHEMA) is None
               and r.parsed == json.loads(r.text)),
    "pydantic": (dict(response_format=Item), lambda r: isinstance(r.parsed, Item)
                 and r.parsed == Item.model_validate_json(r.text)),
    "regex": (dict(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda r: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", r.text)
              and r.parsed == r.text),
    "choices": (dict(choices=["yes", "no", "unsure"]), lambda r: r.text in ("yes", "no", "unsure")
                and r.parsed == r.text),
    "grammar": (dict(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'),
                lambda r: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", r.text) and r.parsed == r.text),
}
MODES = {"greedy": {}, "seeded": dict(temperature=0.9, seed=5)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("constrained")
    return {"m": build_tiny_model(root / "m", seed=0), "other": build_tiny_model(root / "other", seed=1)}


@pytest.fixture
def eng(dirs, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as e:
        e.load_model(dirs["m"], name="m")
        yield e


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_kind_parses(eng, kind, mode):
    options, check = KINDS[kind]
    r = eng.generate(PROMPT, max_tokens=200, use_cache=False, **options, **MODES[mode])
    assert r.stats["finish_reason"] == "eos" and r.stats["constraint_incomplete"] is None, r.text
    assert check(r), (r.text, r.parsed)
    assert r.stats["constraint"] == {"schema": "json", "pydantic": "json", "choices": "choice"}.get(kind, kind)
    free = eng.generate(PROMPT, max_tokens=30, use_cache=False, **MODES[mode])
    assert free.parsed is None and "constraint" not in free.stats and not check_quietly(check, free)


def check_quietly(check, r) -> bool:
    try:
        return bool(check(r))
    except Exception:
        return False


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_grammar_allowing_every_token_gives_plain_decodings_tokens(eng, mode):
    free = eng.generate(PROMPT, max_tokens=40, use_cache=False, **MODES[mode])
    assert all(t > 2 for t in free.tokens), "the plain answer holds a special token the grammar forbids"
    constrained = eng.generate(PROMPT, max_tokens=40, use_cache=False, grammar=ANY_BYTES, **MODES[mode])
    assert constrained.tokens == free.tokens and constrained.text == free.text
    narrower = eng.generate(PROMPT, max_tokens=40, use_cache=False, regex="[a-z]{40}", **MODES[mode])
    assert narrower.tokens != free.tokens  # (the grammar does change what it forbids)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_drafts_under_a_grammar_give_plain_decodings_tokens(eng, dirs, mode):
    eng.load_model(dirs["m"], name="twin")
    eng.load_model(dirs["other"], name="small")
    options = dict(max_tokens=120, use_cache=False, response_format=SCHEMA, **MODES[mode])
    plain = eng.generate(PROMPT, lookup=False, **options)
    assert plain.stats["finish_reason"] == "eos"
    twin = eng.generate(PROMPT, draft="twin", lookup=False, **options)
    small = eng.generate(PROMPT, draft="small", num_draft_tokens=3, lookup=False, **options)
    looked = eng.generate(PROMPT, lookup=True, **options)
    for r in (twin, small, looked):
        assert r.tokens == plain.tokens and r.parsed == plain.parsed
    # the draft proposes under the row's grammar: a twin's proposals are all kept
    assert twin.stats["draft_tokens_proposed"] > 10 and twin.stats["draft_acceptance"] == 1.0
    assert small.stats["draft_tokens_proposed"] > 10


def test_a_grammar_that_cannot_roll_back_decodes_without_drafts(eng, dirs):
    """llguidance cannot roll back a lexeme with max_tokens= or stop=: the row's grammar is rebuilt from
    the tokens it kept, and it proposes no more drafts; the tokens are plain decoding's."""
    eng.load_model(dirs["m"], name="twin")
    capped = 'start: word "." num\nword[max_tokens=6]: /[a-z]+/\nnum: /[0-9]{2,12}/'
    options = dict(max_tokens=60, use_cache=False, grammar=capped, temperature=0.9, seed=1)
    plain = eng.generate(PROMPT, lookup=False, **options)
    assert re.fullmatch(r"[a-z]+\.[0-9]{2,12}", plain.text) and plain.stats["finish_reason"] == "eos"
    for drafted in (eng.generate(PROMPT, draft="twin", lookup=False, **options), eng.generate(PROMPT, lookup=True,
                                                                                                **options)):
        assert drafted.tokens == plain.tokens and drafted.parsed == plain.parsed


def test_a_draft_the_grammar_forbids_is_never_forwarded(eng, monkeypatch):
    forwarded = []
    original = loop.OneRow.__call__

    def recording(self, feeds, drafts=()):
        if not hasattr(feeds, "shape") and any(drafts):
            forwarded.append(feeds[0][len(feeds[0]) - drafts[0]:])
        return original(self, feeds, drafts)

    monkeypatch.setattr(loop.OneRow, "__call__", recording)
    prompt = "12ab12ab12ab12ab12ab12ab12ab12ab"  # the context proposes letters after "12"
    plain = eng.generate(prompt, raw=True, max_tokens=24, use_cache=False, lookup=False, regex="[0-9]{24}")
    looked = eng.generate(prompt, raw=True, max_tokens=24, use_cache=False, lookup=True, regex="[0-9]{24}")
    assert looked.tokens == plain.tokens and re.fullmatch("[0-9]{24}", looked.text)
    assert looked.stats["constraint_drafts_forbidden"] >= 1 and looked.stats["lookup_drafts_proposed"] >= 1
    tok = eng.models.get("m").tokenizer
    assert all(re.fullmatch("[0-9]*", tok.decode(d)) for d in forwarded), forwarded


def test_ram_and_ssd_hits_in_a_new_process_answer_as_a_cold_run(dirs, tmp_path):
    options = dict(max_tokens=120, response_format=SCHEMA, temperature=0.9, seed=2)
    with Engine(cache_dir=tmp_path / "cold", ssd=False) as ref:
        ref.load_model(dirs["m"], name="m")
        cold = ref.generate(PROMPT, use_cache=False, **options)
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(dirs["m"], name="m")
        first = eng.generate(PROMPT, **options)
        ram = eng.generate(PROMPT, **options)
        assert ram.stats["cache_source"] == "ram" and first.tokens == ram.tokens == cold.tokens
        assert ram.parsed == cold.parsed and ram.parsed is not None
    script = (f"import json; from mlxcache_kernel.engine import Engine\n"
              f"with Engine(cache_dir={str(tmp_path / 'c')!r}, prefetch_budget_bytes=0) as eng:\n"
              f"    eng.load_model({str(dirs['m'])!r}, name='m')\n"
              f"    r = eng.generate({PROMPT!r}, **{options!r})\n"
              f"    print(json.dumps([r.tokens, r.parsed, r.stats['cache_source'], r.stats['constraint_cached']]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    tokens, parsed, source, cached = json.loads(out.stdout.strip().splitlines()[-1])
    assert source == "ssd" and tokens == cold.tokens and parsed == cold.parsed and cached is False


def test_objects_hold_only_the_keys_they_name_unless_the_schema_allows_others(eng):
    from mlxcache_kernel.engine.generate.grammars import strict

    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "x-guidance": COMPACT}
    for seed in range(4):  # (a random model adds keys where the grammar lets it)
        r = eng.generate(PROMPT, max_tokens=300, use_cache=False, response_format=schema, temperature=1.0, seed=seed)
        assert set(r.parsed) <= {"a"}, r.text
    nested = {"$defs": {"P": {"type": "object", "properties": {"x": {"type": "string"}}}},
              "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}, "q": {"anyOf": [
                  {"type": "object", "properties": {"y": {"type": "integer"}}}, {"type": "null"}]}},
              "required": ["p"]}
    tight = strict(nested)
    assert tight["additionalProperties"] is False and tight["$defs"]["P"]["additionalProperties"] is False
    assert tight["properties"]["q"]["anyOf"][0]["additionalProperties"] is False and "additionalProperties" not in nested
    loose = {**nested, "additionalProperties": True}
    assert strict(loose)["additionalProperties"] is True and strict({"type": "object"}) == {"type": "object"}
    extra = [eng.generate(PROMPT, max_tokens=300, use_cache=False, temperature=1.0, seed=seed,
                          response_format={**schema, "additionalProperties": True}) for seed in range(4)]
    assert any(r.parsed and set(r.parsed) - {"a"} for r in extra), [r.text for r in extra]


def test_an_answer_cut_by_max_tokens_is_incomplete(eng):
    r = eng.generate(PROMPT, max_tokens=5, response_format=SCHEMA)
    assert r.parsed is None and r.stats["finish_reason"] == "length"
    assert r.stats["constraint_incomplete"] == "incomplete JSON (max tokens)"
    stopped = eng.generate(PROMPT, max_tokens=60, choices=["yes", "no"], stop=["e"], use_cache=False)
    assert stopped.parsed is None and stopped.stats["constraint_incomplete"] == "incomplete choice (stop string)"


def test_logprobs_are_of_the_constrained_distribution(eng):
    r = eng.generate(PROMPT, max_tokens=8, choices=["yes", "no", "unsure"], logprobs=5, use_cache=False)
    first = r.logprobs[0]
    tok = eng.models.get("m").tokenizer
    assert {tok.decode([t]) for t, _ in first.top} == {"y", "n", "u"}  # the alternatives the grammar allows
    assert math.isclose(sum(math.exp(lp) for _, lp in first.top), 1.0, rel_tol=1e-4)
    [model] = eng.score(r.prompt_tokens, [r.tokens[:1]])  # the model's own (unconstrained) log-probability
    assert model.logprob < first.logprob  # renormalized over the allowed tokens


def test_a_template_that_forces_an_opening_constrains_the_answer_after_it(dirs, tmp_path):
    path = build_tiny_model(tmp_path / "thinking", seed=0)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML.replace("assistant\n{% endif %}", "assistant\n<think>\n\n</think>\n\n{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with Engine(cache_dir=tmp_path / "c", ssd=False) as eng:
        eng.load_model(path, name="t")
        r = eng.generate(PROMPT, max_tokens=200, response_format=Item, use_cache=False)
        assert eng.models.get("t").tokenizer.decode(r.prompt_tokens).endswith("<think>\n\n</think>\n\n")
        assert isinstance(r.parsed, Item)


def test_with_quantized_kv(tmp_path):
    wide = build_tiny_model(tmp_path / "wide", hidden=128)  # heads of 32: one quantization group
    with Engine(cache_dir=tmp_path / "c", ssd=False) as eng:
        eng.load_model(wide, name="q", kv_bits=8, kv_group_size=32, kv_start=0)
        free = eng.generate(PROMPT, max_tokens=40, use_cache=False)
        assert eng.generate(PROMPT, max_tokens=40, grammar=ANY_BYTES).tokens == free.tokens
        r = eng.generate(PROMPT, max_tokens=200, response_format=Item)
        again = eng.generate(PROMPT, max_tokens=200, response_format=Item)
        assert isinstance(r.parsed, Item) and again.parsed == r.parsed and again.stats["cache_source"] == "ram"


def test_compiled_grammars_are_cached_per_tokenizer_and_grammar(eng):
    class Other(Item):  # the same schema, another class: each validates into its own
        model_config = ConfigDict(title="Item")

    first = eng.generate(PROMPT, max_tokens=200, response_format={**SCHEMA, "title": "fresh"}, use_cache=False)
    again = eng.generate(PROMPT, max_tokens=200, response_format={**SCHEMA, "title": "fresh"}, use_cache=False)
    assert first.stats["constraint_cached"] is False and again.stats["constraint_cached"] is True
    assert again.tokens == first.tokens
    a = eng.generate(PROMPT, max_tokens=200, response_format=Item, use_cache=False)
    b = eng.generate(PROMPT, max_tokens=200, response_format=Other, use_cache=False)
    assert type(a.parsed) is Item and type(b.parsed) is Other and b.stats["constraint_cached"] is True


def test_bad_constraints_are_one_line_errors_that_lose_nothing(eng, dirs, tmp_path):
    bad = [(dict(regex="a(b"), "regex.*unclosed group"),
           (dict(response_format={"type": "strin"}), "JSON Schema: Invalid type: strin"),
           (dict(response_format={"type": "string", "format": "weird"}), "Unknown format: weird"),
           (dict(grammar="start: foo"), 'unknown name: "foo"'),
           (dict(choices="yes|no"), "choices must be a non-empty list of strings"),
           (dict(choices=["yes", ""]), "non-empty strings"),
           (dict(response_format=42), "Pydantic model class or a JSON Schema dict, got int"),
           (dict(regex="[0-9]", choices=["a"]), "one constraint at a time: got regex and choices")]
    for options, message in bad:
        with pytest.raises(ConstraintError, match=message) as e:
            eng.generate(PROMPT, session="s", **options)
        assert "\n" not in str(e.value) and isinstance(e.value, GenerationError)
        with pytest.raises(ConstraintError, match=message):
            eng.generate_tokens([5, 6, 7], **options)
    assert eng.sessions.list() == [] and eng.admin.entries() == []  # refused before any work

    words = tmp_path / "words"  # a tokenizer llguidance cannot read (word-level, no decoder)
    build_tiny_model(words)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel(vocab={"<eos>": 0, "<unk>": 1, "yes": 2, "no": 3}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(words / "tokenizer.json"))
    (words / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "eos_token": "<eos>", "unk_token": "<unk>"}))
    eng.load_model(words, name="words")
    with pytest.raises(ConstraintError, match="model 'words': llguidance cannot read its tokenizer"):
        eng.generate("yes no", model="words", raw=True, choices=["yes"])
