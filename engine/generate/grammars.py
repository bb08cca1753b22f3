"""What a constrained answer must look like: a JSON Schema or Pydantic model (`response_format`), a regex,
choices or a Lark / GBNF grammar, as one llguidance grammar (`spec_of`), compiled for a model's tokenizer
(`compile_for`: the tokenizer's tables once per tokenizer, each grammar once per tokenizer), and what an
answer parses to (`Spec.parse`).

Why llguidance (measured here, docs/benchmarks.md): abi3 wheels for macOS arm64 and Linux with no
required dependencies (xgrammar 0.2.8 requires torch, and triton on Linux x86_64); at SmolLM2's 49k
vocabulary a 10-field schema compiles in about a millisecond and its mask and accepted token cost
10-30 us alone (under 1% of a decode step on MLX's CPU backend); its matcher rolls back, which drafts
need. mlx-vlm depends on it already.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import blake3

from ..errors import ConstraintError

OPTIONS = ("response_format", "regex", "choices", "grammar")  # generate's keywords, in this order; one at most
# Whitespace between JSON tokens: at most this many characters (llguidance allows any run by default, and a
# weak model can loop on blank lines). A schema's own "x-guidance" options override it.
JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,12}"}
TOKENIZERS_KEPT, GRAMMARS_KEPT = 4, 64  # compiled tables kept (least recently used go first)


@dataclass(frozen=True)
class Spec:
    """One constraint as llguidance takes it; `kind` is json, regex, choice or grammar."""

    kind: str
    grammar: str = field(repr=False)  # llguidance's grammar (a JSON text)
    model: Any = field(default=None, repr=False)  # a Pydantic model class the answer validates into

    @property
    def key(self) -> str:
        """What identifies the constraint (resume records, the compiled-grammar cache)."""
        return blake3.blake3(self.grammar.encode()).hexdigest()[:32]

    @property
    def what(self) -> str:
        """How the footer names an answer of this kind: 'incomplete JSON (max tokens)'."""
        return {"json": "JSON", "regex": "regex match", "choice": "choice", "grammar": "grammar match"}[self.kind]

    def parse(self, text: str) -> tuple:
        """(the parsed answer, None), or (None, why not) for a text the matcher accepted."""
        if self.kind != "json":
            return text, None
        try:
            value = json.loads(text)
        except ValueError as e:
            return None, f"not JSON ({e})"
        if self.model is None:
            return value, None
        try:
            return self.model.model_validate(value), None
        except ValueError as e:  # (pydantic's ValidationError): a validator the schema does not express
            first = str(e).splitlines()
            return None, f"JSON does not validate ({' '.join(first[1:3]).strip() or first[0]})"


def _is_pydantic(x) -> bool:
    return isinstance(x, type) and callable(getattr(x, "model_json_schema", None)) and hasattr(x, "model_validate")


def strict(schema):
    """The schema with `"additionalProperties": false` on every object schema that lists its properties and
    says nothing about others (a copy): only the keys it names, as xgrammar's strict mode and OpenAI's
    strict schemas do. A schema that says `"additionalProperties": true` (or gives a schema) keeps it."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k not in ("enum", "const", "default", "examples", "x-guidance") else v
           for k, v in schema.items()}
    if "properties" in out and not {"additionalProperties", "unevaluatedProperties", "patternProperties"} & set(out):
        out["additionalProperties"] = False
    return out


def _json_spec(value) -> Spec:
    model = value if _is_pydantic(value) else None
    if model is not None:
        schema = model.model_json_schema()
    elif isinstance(value, dict):
        schema = value
        if value.get("type") == "json_object":  # OpenAI's response_format shapes
            schema = {"type": "object"}
        elif value.get("type") == "json_schema":
            schema = (value.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ConstraintError("response_format: a {'type': 'json_schema'} needs json_schema.schema, a dict")
    else:
        raise ConstraintError(f"response_format must be a Pydantic model class or a JSON Schema dict, got "
                              f"{type(value).__name__}")
    from llguidance import LLMatcher

    try:
        own = isinstance(schema.get("x-guidance"), dict) and {"whitespace_flexible", "whitespace_pattern"} & set(
            schema["x-guidance"])  # (our pattern would override the schema's own choice)
        grammar = LLMatcher.grammar_from_json_schema(strict(schema), defaults=None if own else JSON_DEFAULTS)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"response_format: not a JSON Schema: {_one_line(str(e))}") from None
    return Spec("json", grammar, model)


def spec_of(*, response_format=None, regex=None, choices=None, grammar=None) -> Spec | None:
    """The constraint a call asks for (at most one of the four), or None; bad input is a ConstraintError."""
    given = [name for name, v in zip(OPTIONS, (response_format, regex, choices, grammar)) if v is not None]
    if len(given) > 1:
        raise ConstraintError(f"one constraint at a time: got {' and '.join(given)}")
    if not given:
        return None
    from llguidance import grammar_from

    if response_format is not None:
        return _json_spec(response_format)
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ConstraintError(f"regex must be a non-empty string, got {regex!r}")
        return Spec("regex", grammar_from("regex", regex))
    if choices is not None:
        if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
            raise ConstraintError(f"choices must be a non-empty list of strings, got {choices!r}")
        if not all(isinstance(c, str) and c for c in choices):
            raise ConstraintError("choices must be non-empty strings")
        return Spec("choice", grammar_from("choice", list(choices)))
    if not isinstance(grammar, str) or not grammar.strip():
        raise ConstraintError(f"grammar must be a Lark or GBNF grammar (a string), got {type(grammar).__name__}")
    try:
        return Spec("grammar", grammar_from("grammar", grammar))
    except ValueError as e:  # a GBNF grammar the converter refused
        raise ConstraintError(f"grammar: {_one_line(str(e))}") from None


def _one_line(message: str) -> str:
    """llguidance's message without its source excerpts and carets, on one line."""
    lines = [ln.strip() for ln in message.splitlines()]
    kept = [ln for ln in lines if ln and not set(ln) <= set("^ ") and not ln.split("|")[0].strip().isdigit()]
    return " ".join(kept) or message.strip()


@dataclass(frozen=True)
class Compiled:
    """A grammar compiled for one model's tokenizer: `matcher` is never advanced, each row gets a copy."""

    spec: Spec
    matcher: Any = field(repr=False)  # a fresh llguidance LLMatcher
    vocab: int  # the tokenizer's vocabulary as llguidance sees it (mask bits)
    eos: frozenset  # the model's end tokens (the grammar allows them where the answer may end)
    compile_s: float  # what compiling it cost (the tokenizer's tables included when they were built for it)
    cached: bool = False  # this call found it compiled


_tokenizers: OrderedDict = OrderedDict()  # (tokenizer identity, eos ids) -> llguidance LLTokenizer
_compiled: OrderedDict = OrderedDict()  # (tokenizer key, grammar key) -> Compiled


def _kept(cache: OrderedDict, key, make, limit: int):
    if key in cache:
        cache.move_to_end(key)
        return cache[key], True
    value = cache[key] = make()
    while len(cache) > limit:
        cache.popitem(last=False)
    return value, False


def _tokenizer(model) -> tuple:
    """(llguidance's tokenizer for the model, its cache key); a tokenizer it cannot read is a ConstraintError."""
    eos = sorted(model.eos_token_ids)
    key = (model.identity.get("tokenizer") or model.name, tuple(eos))

    def make():
        from llguidance import LLTokenizer

        backend = getattr(getattr(model.tokenizer, "_tokenizer", None), "backend_tokenizer", None)
        if backend is None:
            raise ConstraintError(f"model {model.name!r}: llguidance cannot read its tokenizer (constrained answers "
                                  "need a fast Hugging Face tokenizer, a tokenizer.json)")
        try:
            return LLTokenizer(backend.to_str(), eos_token=eos)
        except Exception as e:
            raise ConstraintError(f"model {model.name!r}: llguidance cannot read its tokenizer: "
                                  f"{_one_line(str(e))}") from None

    return _kept(_tokenizers, key, make, TOKENIZERS_KEPT)[0], key


def compile_for(model, spec: Spec) -> Compiled:
    """`spec` compiled for `model`'s tokenizer (cached per tokenizer and grammar); a grammar llguidance
    refuses is a ConstraintError naming the part it refused."""
    t0 = time.perf_counter()
    tokenizer, tkey = _tokenizer(model)

    def make() -> Compiled:
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(spec.grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise ConstraintError(f"cannot compile the {spec.kind if spec.kind != 'json' else 'JSON Schema'}: "
                                  f"{_one_line(error)}")
        matcher = LLMatcher(tokenizer, spec.grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"cannot compile the {spec.kind}: {_one_line(matcher.get_error())}")
        return Compiled(spec, matcher, tokenizer.vocab_size, frozenset(model.eos_token_ids), time.perf_counter() - t0)

    compiled, hit = _kept(_compiled, (tkey, spec.key), make, GRAMMARS_KEPT)
    # (a hit keeps the caller's spec: two Pydantic classes of one schema validate into their own class)
    return replace(compiled, spec=spec, compile_s=time.perf_counter() - t0, cached=True) if hit else compiled


def constraint_of(model, *values) -> Compiled | None:
    """What generate's keywords (the values of OPTIONS, in order) ask for, compiled for `model`, or None;
    refused with a ConstraintError before any work."""
    spec = spec_of(**dict(zip(OPTIONS, values)))
    return compile_for(model, spec) if spec is not None else None


def _per_row(name: str, value) -> bool:
    """Whether a generate_batch keyword holds one value per row (a list; for choices, a list of lists)."""
    if not isinstance(value, (list, tuple)):
        return False
    return name != "choices" or any(v is None or isinstance(v, (list, tuple)) for v in value)


def constraints_of(model, rows: int, *values) -> list:
    """generate_batch's keywords (the values of OPTIONS, in order) as each row's compiled constraint (or
    None): one value for every row, or a list with one per row (rows may ask for different kinds)."""
    kinds, per_row = dict(zip(OPTIONS, values)), {}
    for name, value in kinds.items():
        if value is not None and _per_row(name, value):
            if len(value) != rows:
                raise ConstraintError(f"{name}: a list needs one value per prompt ({rows}), got {len(value)}")
            per_row[name] = list(value)
    out = []
    for i in range(rows):
        try:
            out.append(constraint_of(model, *(per_row[k][i] if k in per_row else v for k, v in kinds.items())))
        except ConstraintError as e:
            raise ConstraintError(f"prompt {i}: {e}" if per_row else str(e)) from None
    return out
