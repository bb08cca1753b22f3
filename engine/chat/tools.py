"""The notebook's functions as tools: their JSON Schemas (transformers' `get_json_schema`: the signature,
type hints and the docstring's Args), the calls a reply holds in its family's format (mlx-lm's own
parsers for `<tool_call>` JSON and Mistral's `[TOOL_CALLS]`; Llama 3.x's JSON answer and gpt-oss's
commentary to=functions.NAME here), running a call (an exception is the result the model reads), the
messages a template reads back, and the grammar a required call follows (`call_grammar`, for the
structured-output constraint: arguments valid for the schema, JSON written as the template's `tojson`
writes it, so the next step's prompt renders the very tokens the model generated).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ToolError
from .templates import Family

CHOICES = ("auto", "required", "none")
CALL_ENDS = {"harmony": "<|call|>", "llama3": "<|eot_id|>"}
# JSON as the templates' tojson writes it (json.dumps's separators): the call renders back token for token
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolCall:
    """One call the model made: `name`, `arguments` (a dict), and what came back: `result` (the
    function's value) or `error` (the exception or refusal, as the model read it)."""

    name: str
    arguments: dict
    id: str
    result: Any = None
    error: str | None = None
    ran: bool = field(default=False, repr=False)

    @property
    def text(self) -> str:
        """The result as the model reads it."""
        if self.error is not None:
            return f"Error: {self.error}"
        if isinstance(self.result, str):
            return self.result
        try:
            return json.dumps(self.result, ensure_ascii=False)
        except (TypeError, ValueError):
            return repr(self.result)


class Toolbox:
    """The functions a generation may call, by name, with their schemas."""

    def __init__(self, tools):
        if callable(tools) or isinstance(tools, (str, bytes, dict)):
            raise ToolError("tools must be a list of functions, e.g. tools=[get_weather, search]")
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for fn in tools:
            if not callable(fn):
                raise ToolError(f"tools: {fn!r} is not a function")
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(fn)
            except Exception as e:  # no docstring, an argument without a type hint or a description
                raise ToolError(f"tool {getattr(fn, '__name__', fn)!r}: {e} (write a docstring with an Args: "
                                f"section and type hints)") from None
            name = schema["function"]["name"]
            if name in self.functions:
                raise ToolError(f"tools: two tools are named {name!r}")
            self.functions[name] = fn
            self.schemas.append(schema)

    @property
    def names(self) -> list[str]:
        return list(self.functions)

    def run(self, call: ToolCall) -> ToolCall:
        """Run the call in the caller's thread; its exception becomes the result the model reads."""
        fn = self.functions.get(call.name)
        if fn is None:
            call.error = f"unknown tool {call.name!r}; the tools are {', '.join(self.names)}"
            return call
        try:
            call.result = fn(**call.arguments)
        except Exception as e:
            call.error = f"{type(e).__name__}: {e}"
        call.ran = True
        return call


def parse_calls(family: Family, texts: list[tuple], answer: str, next_id: Callable[[], str]) -> list[ToolCall]:
    """The calls in a reply: `texts` the split's call sections [(recipient, text)], `answer` its answer
    (a Llama 3.x call is the whole answer). A section that does not parse is not a call."""
    found: list[tuple[str, Any]] = []
    for recipient, text in texts:
        try:
            if family.name == "harmony":
                found.append((recipient, json.loads(text)))
            elif family.name == "mistral":
                from mlx_lm.tool_parsers.mistral import parse_tool_call

                parsed = parse_tool_call(text)
                found += [(p["name"], p["arguments"]) for p in (parsed if isinstance(parsed, list) else [parsed])]
            else:  # <tool_call> JSON (mlx-lm's json_tools), Llama's <|python_tag|>
                from mlx_lm.tool_parsers.json_tools import parse_tool_call

                parsed = parse_tool_call(text)
                found.append((parsed["name"], parsed.get("arguments", parsed.get("parameters"))))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    if family.name == "llama3" and not texts:
        try:
            parsed = json.loads(answer)
            if isinstance(parsed, dict) and set(parsed) == {"name", "parameters"}:
                found.append((parsed["name"], parsed["parameters"]))
        except ValueError:
            pass
    return [ToolCall(str(name), args, next_id()) for name, args in found
            if isinstance(name, str) and isinstance(args, dict)]


def assistant_message(family: Family, content: str, reasoning: str, calls: list[ToolCall]) -> dict:
    """The reply as the template reads it back: its reasoning in the family's field, its calls."""
    msg: dict = {"role": "assistant", "content": content}
    if reasoning and family.field:
        msg[family.field] = reasoning
    if calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in calls]
    return msg


def result_message(call: ToolCall) -> dict:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": call.text}


def call_grammar(family: Family, schemas: list[dict], vocab: dict, think: bool, budget: int | None = None) -> str:
    """A Lark grammar (llguidance's) of one call of one of these tools in the family's format (one call a
    step: a step's calls run before the next step), the arguments valid for the tool's schema; with
    `think`, a reasoning block of at most `budget` tokens may come first (a lexeme that cannot roll back:
    no drafts under it). A marker that is one token of the vocabulary is written as that token."""

    def tok(marker: str) -> str:
        return f"<[{vocab[marker]}]>" if marker in vocab else lit(marker)

    rules, names = [], []
    for i, schema in enumerate(schemas):
        name = schema["function"]["name"]
        params = {"additionalProperties": False,  # a function takes the arguments its signature names
                  **(schema["function"].get("parameters") or {"type": "object", "properties": {}})}
        quoted = json.dumps(name, ensure_ascii=False)
        if family.name == "harmony":  # the recipient in the role, as gpt-oss's template renders a call back
            body = [lit(f" to=functions.{name}"), tok("<|channel|>"), lit("commentary json"), tok("<|message|>"),
                    f"args{i}"]
        elif family.name == "mistral":
            body = [tok("[TOOL_CALLS]"), lit(name), tok("[ARGS]"), f"args{i}"]
        elif family.name == "llama3":
            body = [lit('{"name": ' + quoted + ', "parameters": '), f"args{i}", lit("}")]
        else:  # <tool_call> JSON
            body = [tok("<tool_call>"), lit('\n{"name": ' + quoted + ', "arguments": '), f"args{i}", lit("}\n"),
                    tok("</tool_call>")]
        rules += [f"call{i}: " + " ".join(body), f"args{i}: %json " + json.dumps({**params, "x-guidance": JSON_FORMAT})]
        names.append(f"call{i}")
    end = CALL_ENDS.get(family.name)  # the end token the template renders after a call (of the model's end tokens)
    lines = ["start: think calls" if think else "start: calls", "calls: call" + (f" {tok(end)}" if end in vocab else ""),
             "call: " + " | ".join(names), *rules]
    capped = f"reasoning[max_tokens={budget}]: REASONING" if budget else "reasoning: REASONING"
    if think and family.name == "harmony":
        lines += [f'think: ({tok("<|channel|>")} "analysis" {tok("<|message|>")} reasoning {tok("<|end|>")} '
                  f'{tok("<|start|>")} "assistant")?', capped, "REASONING: /(?s:.+)/"]
    elif think and family.think:  # written as templates render it back: newlines around the reasoning, not in it
        start, end = family.think
        lines += [f'think: ({tok(start)} reasoning {tok(end)} "\\n\\n")?', capped,  # (one lexeme up to the end marker)
                  f"REASONING: /\\n[^\\n](?s:.*[^\\n])?\\n/ & ~/(?s:.*{_escape(end)}.*)/"]
    else:
        lines[0] = "start: calls"
    return "\n".join(lines) + "\n"


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _escape(text: str) -> str:
    """`text` literally inside a Lark /regex/ (escaping only regex syntax: \\< is a word boundary there)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/&~-" else c for c in text)
