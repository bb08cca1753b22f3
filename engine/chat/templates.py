"""Chat templates: rendering a conversation with the options people run modern models with
(keywords such as `enable_thinking` or `reasoning_effort`, the tools, a pinned clock for the dates
a template writes), another template than the model's own (`load_model(chat_template=...)`), and
the family a template belongs to: where its reasoning goes, the message field its template reads
the reasoning from, and how its tool calls look.

Dates: Llama 3.x, gpt-oss and Mistral write today's date into the system header through
`strftime_now`. A session pins the clock its template reads when it is created (`clock=`), so its
prefix renders the same tokens tomorrow; a one-off prompt renders today's date.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..errors import GenerationError, ModelError

THINK_KEYWORDS = ("enable_thinking", "thinking")  # the templates' on/off switches, first found wins


def read_template(path_or_text) -> str:
    """A chat template from a file (.jinja, or a tokenizer_config.json's "chat_template") or the text itself."""
    text = str(path_or_text)
    if "{%" in text or "{{" in text:
        return text
    path = Path(text).expanduser()
    if not path.is_file():
        raise ModelError(f"chat_template: {text!r} is neither a file nor a Jinja template")
    body = path.read_text()
    if path.suffix == ".json":
        import json

        body = json.loads(body).get("chat_template")
        if isinstance(body, list):  # [{"name": "default", "template": ...}, ...]
            body = next((t["template"] for t in body if t.get("name") == "default"), body[0]["template"])
        if not isinstance(body, str):
            raise ModelError(f"chat_template: {path} has no chat_template")
    return body


def source(tok) -> str:
    t = getattr(tok, "chat_template", None)
    return t if isinstance(t, str) else ""


def thinking_keyword(tok) -> str | None:
    """The keyword the template turns thinking on and off with, or None when it has none."""
    src = source(tok)
    for word in THINK_KEYWORDS:
        if re.search(rf"(?<![\w.'\"]){word}\s+is\s+(not\s+)?(defined|false|true|none)|if\s+(not\s+)?{word}\b", src):
            return word
    return None


def template_options(tok, template_args: dict | None, think: bool | None) -> dict:
    """The keywords a render passes to the template: `template_args`, and `think` as the template's own switch."""
    args = dict(template_args or {})
    for key in args:
        if not isinstance(key, str) or not key.isidentifier():
            raise GenerationError(f"template_args: {key!r} is not a template keyword (a name like reasoning_effort)")
    if think is not None:
        word = thinking_keyword(tok)
        if word is None:
            raise GenerationError("this model's chat template has no thinking switch (enable_thinking): pass its own "
                                  "keyword in template_args, e.g. reasoning_effort='low'")
        args[word] = bool(think)
    return args


@contextmanager
def pinned_clock(tok, timestamp: float | None):
    """While rendering, the template's `strftime_now` reads `timestamp` instead of now.

    transformers hands the template only plain data (a function passed as a keyword arrives as
    text), so the pin swaps the function in the environment of the compiled template it renders
    with (compiled once per template text), for the length of one render on the owner thread.
    """
    env = None
    if timestamp is not None and source(tok):
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(source(tok)).environment
    if env is None:
        yield
        return
    when = datetime.fromtimestamp(timestamp)
    saved = env.globals.get("strftime_now")
    env.globals["strftime_now"] = when.strftime
    try:
        yield
    finally:
        env.globals["strftime_now"] = saved


def render(tok, messages: list, *, tools: list | None = None, options: dict | None = None,
           clock: float | None = None, generation_prompt: bool = True) -> str:
    """The conversation as text, up to where the assistant's reply begins (the one call of the template).
    clock: the time its dates are rendered at (None: now)."""
    if not getattr(tok, "chat_template", None):
        return "\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
    from jinja2 import TemplateError

    kwargs = dict(options or {}, **({"tools": tools} if tools else {}))
    try:
        with pinned_clock(tok, clock):
            return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)
    except TemplateError as e:  # a template's raise_exception or a Jinja error: one line naming it
        raise GenerationError(f"the chat template refused this conversation: {e}") from None


@dataclass(frozen=True)
class Family:
    """How a template's model writes reasoning and tool calls, and where the template reads reasoning back.

    name: "harmony" (gpt-oss's channels), "llama3" (a JSON call as the whole answer), "mistral"
    ([TOOL_CALLS]), "hermes" (<tool_call> JSON: Qwen, Hermes) or "plain" (no tool calls);
    think: the (start, end) markers of a reasoning block, or None; field: the assistant message's
    reasoning field the template reads ("reasoning_content", "thinking"), or None to keep the
    reasoning in the content as the model wrote it.
    """

    name: str
    think: tuple | None = None
    field: str | None = None

    @property
    def calls_tools(self) -> bool:
        return self.name != "plain"


def family_of(tok) -> Family:
    src = source(tok)
    think = None
    if getattr(tok, "has_thinking", False) and tok.think_start and tok.think_end:  # mlx-lm's own inference
        think = (tok.think_start, tok.think_end)
    elif "<think>" in src and "</think>" in src:  # a template that thinks, over a vocabulary without the tokens
        think = ("<think>", "</think>")
    if "<|channel|>" in src:
        return Family("harmony", None, "thinking")
    field = "reasoning_content" if "reasoning_content" in src else None
    if "[TOOL_CALLS]" in src:
        name = "mistral"
    elif "<tool_call>" in src:
        name = "hermes"
    elif "<|start_header_id|>" in src and "parameters" in src and "tool_calls" in src:
        name = "llama3"
    else:
        name = "plain"
    return Family(name, think, field)
