"""``%%generate`` as people run modern chat models: ``--think`` / ``--no-think`` and ``--template-arg
KEY=VALUE`` (the chat template's own keywords, e.g. ``reasoning_effort=low``; a session remembers them),
``--tools f,g`` (functions of the notebook the model may call) with ``--tool-choice``, ``--max-steps``
and ``--confirm``; the reasoning streams into a collapsed "thinking" area above the answer, and each
tool call shows with its result as it happens (engine/chat/turn.py does the work).
"""

from __future__ import annotations

import html
import json
import sys
import time

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument
from IPython.display import display

__all__ = ["chat_arguments", "chat_options", "Thinking", "show_step", "steps_phrase"]


def chat_arguments(func):
    """The options, on ``%%generate``."""
    for flag, kw in reversed((
        ("--think", dict(action="store_true", help="turn the model's thinking on (its template's enable_thinking)")),
        ("--no-think", dict(action="store_true", help="turn the model's thinking off (Qwen3: an empty think block)")),
        ("--template-arg", dict(action="append", default=[], metavar="KEY=VALUE",
                                help="a chat-template keyword, e.g. reasoning_effort=low (repeatable; JSON values "
                                     "such as true or 3 are read as such); a session remembers them")),
        ("--tools", dict(default=None, metavar="F,G", help="functions of the notebook the model may call (a "
                                                           "docstring with Args: and type hints make their schema)")),
        ("--tool-choice", dict(default=None, choices=["auto", "required", "none"],
                               help="required: every step calls a tool, its arguments valid for the tool's schema "
                                    "(then the model answers); auto: the model decides (default); none: no calls")),
        ("--max-steps", dict(type=int, default=None, metavar="N", help="at most N tool steps, then the answer "
                                                                       "(default 8)")),
        ("--confirm", dict(action="store_true", help="ask before running each tool call")),
    )):
        func = argument(flag, **kw)(func)
    return func


def chat_options(args, namespace: dict) -> dict:
    """The engine's chat keywords the options ask for; a bad one is a UsageError."""
    if args.think and args.no_think:
        raise UsageError("--think and --no-think contradict each other: use one")
    out: dict = {}
    if args.think or args.no_think:
        out["think"] = bool(args.think)
    if args.template_arg:
        out["template_args"] = dict(_key_value(a) for a in args.template_arg)
    if args.tools is not None:
        names = [n.strip() for n in args.tools.split(",") if n.strip()]
        missing = [n for n in names if not callable(namespace.get(n))]
        if not names or missing:
            raise UsageError(f"--tools {args.tools}: {', '.join(missing) or 'no names'}: not a function defined in the "
                             "notebook")
        out["tools"] = [namespace[n] for n in names]
    elif args.tool_choice is not None or args.max_steps is not None or args.confirm:
        raise UsageError("--tool-choice, --max-steps and --confirm go with --tools F,G")
    if args.tool_choice is not None:
        out["tool_choice"] = args.tool_choice
    if args.max_steps is not None:
        out["max_steps"] = args.max_steps
    if args.confirm:
        out["confirm"] = ask
    return out


def _key_value(text: str) -> tuple:
    key, sep, value = text.partition("=")
    if not sep or not key.strip().isidentifier():
        raise UsageError(f"--template-arg {text}: write KEY=VALUE, e.g. reasoning_effort=low")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def ask(call) -> bool:
    """--confirm: the user answers y before a call runs (the kernel's input prompt)."""
    answer = input(f"run {call_text(call)}? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def call_text(call) -> str:
    return f"{call.name}({', '.join(f'{k}={v!r}' for k, v in call.arguments.items())})"


def show_step(step) -> None:
    """Each call of a step and its result (or error), as the loop goes."""
    for call in step.calls:
        result = call.text if len(call.text) <= 200 else call.text[:199] + "…"
        print(f"\n[tool] {call_text(call)} -> {result}", flush=True)


def steps_phrase(steps: list) -> str | None:
    """The footer's part: "3 tool steps (prefilled 44, 31, 31 tokens)"."""
    if not steps:
        return None
    each = ", ".join(str(s.stats.get("prefilled_tokens", "?")) for s in steps)
    return f"{len(steps)} tool step{'s' if len(steps) != 1 else ''} (prefilled {each} tokens)"


class Thinking:
    """``on_reasoning`` for one cell: the reasoning in a collapsed "thinking" area (HTML details, updated in
    place; its text/plain twin for terminals and saved notebooks), opened on the first piece."""

    THROTTLE_S = 0.2

    def __init__(self, enabled: bool = True):
        self.enabled, self.text, self.handle, self.shown_at = enabled, "", None, 0.0

    def __call__(self, piece: str) -> None:
        self.text += piece
        if not self.enabled:
            return
        if self.handle is None:
            self.handle = display(self._bundle(), raw=True, display_id=True)
        elif time.monotonic() - self.shown_at > self.THROTTLE_S:
            self.handle.update(self._bundle(), raw=True)
        self.shown_at = time.monotonic()

    def close(self) -> None:
        if not self.text.strip():
            return
        if self.handle is not None:
            self.handle.update(self._bundle(), raw=True)
        else:  # a terminal: the reasoning before the answer's footer
            print(f"[thinking] {self.text.strip()}", file=sys.stdout)

    def _bundle(self) -> dict:
        body = self.text.strip()
        words = len(body.split())
        return {"text/plain": f"[thinking] {body}",
                "text/html": f"<details class='mlxc-thinking' style='color:#666'><summary>thinking ({words} words)"
                             f"</summary><div style='white-space:pre-wrap;font-size:90%'>{html.escape(body)}</div>"
                             "</details>"}
