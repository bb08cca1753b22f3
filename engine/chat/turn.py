"""One user turn of a chat: rendered with its template options, the reply split into reasoning and
answer as it streams, and with tools, the agent loop: each call the model makes runs (in the caller's
thread, after `confirm` where given), its result goes back as the template's tool message and the
model continues, up to `max_steps` steps, then answers without tools.

Every step is a cache hit: a step's prompt is the previous step's prompt and reply (the very ids the
model generated, `Session.encode_rendered`) plus the tool results and the template's glue, so that is
all a step prefills, wherever the template renders the reply as the model wrote it. A required call
(`tool_choice="required"`) follows the grammar of the family's call format (tools.call_grammar).

An interrupt (or an error) leaves the session as it was before the turn; the steps completed so far
stay recorded (loops.py), so rerunning the same turn continues after them without running their
tools again, and returns what an uninterrupted loop returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..errors import GenerationError, ToolError
from .reasoning import Split, starts_in_reasoning
from .sessions import Session
from .templates import family_of, render, template_options, thinking_keyword
from .tools import CHOICES, ToolCall, Toolbox, assistant_message, call_grammar, parse_calls, result_message

DEFAULT_MAX_STEPS = 8
CALL_ROOM = 128  # tokens a required call's reasoning leaves for the call itself, within max_tokens


@dataclass
class Step:
    """One step of an agent loop: the calls the model made (with their results), what it wrote beside
    them, and the step's own generation stats (prompt_tokens, cached_tokens, prefilled_tokens, ...)."""

    calls: list
    stats: dict
    text: str = ""
    reasoning: str = ""
    prompt_tokens: list = field(default_factory=list, repr=False)  # the step's prompt, as token ids
    tokens: list = field(default_factory=list, repr=False)  # what the model generated
    grammar: str | None = field(default=None, repr=False)  # the call's grammar it followed (tool_choice="required")

    @property
    def call(self) -> str:
        """The (first) tool called."""
        return self.calls[0].name

    @property
    def arguments(self) -> dict:
        return self.calls[0].arguments

    @property
    def result(self):
        return self.calls[0].result

    @property
    def error(self) -> str | None:
        return self.calls[0].error


@dataclass
class ChatOptions:
    """What a turn renders and does beyond sampling: generate()'s chat keywords."""

    template_args: dict | None = None
    think: bool | None = None
    tools: list | None = None
    tool_choice: str | None = None  # "auto" (the default with tools), "required", "none"
    max_steps: int | None = None
    confirm: Callable[[ToolCall], bool] | None = None
    on_reasoning: Callable[[str], None] | None = None
    on_step: Callable[[Step], None] | None = None
    toolbox: Toolbox | None = field(default=None, repr=False)

    @property
    def used(self) -> bool:
        return self.template_args is not None or self.think is not None or self.tools is not None

    def check(self, constraint=None, templated: bool = True) -> "ChatOptions":
        """Refused before any work: `constraint`, the answer's (with tools it needs tool_choice="none");
        `templated`: whether the prompt goes through the chat template (not raw, passages or a VLM's)."""
        if self.used and not templated:
            raise GenerationError("template options and tools need a text model's chat template (not raw or passages)")
        constrained = constraint is not None
        if self.tools is not None:
            self.toolbox = Toolbox(self.tools)
        if self.tool_choice is not None and self.tool_choice not in CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)}, got {self.tool_choice!r}")
        if self.toolbox is None and (self.tool_choice not in (None, "none") or self.max_steps is not None
                                     or self.confirm is not None):
            raise ToolError("tool_choice, max_steps and confirm go with tools=[...]")
        if constrained and self.toolbox is not None and self.tool_choice != "none":
            raise ToolError("a constrained answer (response_format, regex, choices, grammar) goes with tools only "
                            "under tool_choice='none' (a step that may call a tool follows the call's format)")
        if self.max_steps is not None and (not isinstance(self.max_steps, int) or self.max_steps < 0):
            raise ToolError(f"max_steps must be an integer >= 0, got {self.max_steps!r}")
        return self


class Turn:
    """One user turn; `run(generate)` once. generate(ids, on_text, grammar) -> GenerationResult is one
    generation from prompt ids (with the caller's sampling, cache and session options); records(ids,
    schemas, choice, max_steps), where given, opens the loop's crash record (loops.py)."""

    def __init__(self, tok, conv: Session, prompt: str, options: ChatOptions, *, system: str | None = None,
                 on_text: Callable[[str], None] | None = None, records=None, max_tokens: int | None = None):
        self.tok, self.conv, self.prompt, self.options, self.system = tok, conv, prompt, options, system
        self.max_tokens = max_tokens
        self.on_text, self.records = on_text, records
        self.family = family_of(tok)
        box = options.toolbox
        if box is not None and not self.family.calls_tools:
            raise ToolError("this model's chat template has no tool-call format (Qwen/Hermes <tool_call>, Llama 3.x, "
                            "gpt-oss, Mistral): load it with a template that renders tools (chat_template=...)")
        self.choice = (options.tool_choice or "auto") if box is not None else "none"
        self.max_steps = options.max_steps if options.max_steps is not None else DEFAULT_MAX_STEPS
        self.args = {**conv.template_args, **template_options(tok, options.template_args, options.think)}
        self.calls_made = 0

    def run(self, generate) -> tuple:
        """(the final GenerationResult with .text its answer and .reasoning, the steps before it)."""
        conv, box = self.conv, self.options.toolbox
        saved = (conv.history, conv.marks, conv.reused, conv.last_prompt_tokens)
        head = conv.render_messages(self.prompt, self.system)
        turn, added, steps, record = conv.turns + 1, [], [], None
        try:
            while True:
                text = render(self.tok, head + added, tools=box.schemas if box else None, options=self.args,
                              clock=conv.clock)
                ids = conv.encode_rendered(text, self.tok)
                calling = box is not None and self.choice != "none" and len(steps) < self.max_steps
                if record is None and self.records is not None and box is not None:
                    record = self.records(ids, box.schemas, self.choice, self.max_steps)
                split = Split(self.family, starts_in_reasoning(self.family, text))
                replay = record.replay(len(steps), ids) if record is not None else None
                grammar = None
                if replay is None:
                    grammar = self._grammar() if calling and self.choice == "required" else None
                    result = generate(ids, lambda piece: self._show(split.feed(piece)), grammar)
                else:
                    result = replay.result
                    self._show(split.feed(result.text))
                self._show(split.finish())
                shown, (split, raw) = split, self._as_decoded(split, result, text)
                result.stats["prefill_note"] = conv.note
                reasoning = split.reasoning
                conv.remember(ids, result.tokens, turn, reasoning,
                              len(self.tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0)
                calls = [] if not calling else replay.calls if replay is not None else parse_calls(
                    self.family, split.calls, split.answer, self._next_id)
                if not calls:  # the answer
                    content = split.answer.lstrip("\n") if self.family.field else raw
                    added.append(assistant_message(self.family, content, reasoning, []))
                    break
                if replay is None:
                    for call in calls:
                        self._run(call)
                    if record is not None:
                        record.add(result, calls)
                step = Step(calls, result.stats, split.answer.strip(), reasoning.strip(), list(ids), list(result.tokens),
                            grammar)
                steps.append(step)
                added += [assistant_message(self.family, step.text, reasoning, calls)]
                added += [result_message(c) for c in calls]
                if self.options.on_step is not None:
                    self.options.on_step(step)
        except BaseException:
            conv.history, conv.marks, conv.reused, conv.last_prompt_tokens = saved  # the session as before the turn
            raise
        conv.template_args = self.args  # a session remembers its options
        conv.messages += [head[-1]] + added
        if record is not None:
            record.finish()
        result.stats["steps"] = len(steps)
        result.text = shown.answer  # as it streamed
        result.reasoning, result.steps = shown.reasoning.strip(), steps
        return result

    def _as_decoded(self, split: Split, result, prompt_text: str) -> tuple:
        """The reply split again from the tokenizer's decoding of its ids, which is what the next rendering
        is compared with (a streaming detokenizer may differ: mlx-lm's BPE one trims a leading space and
        drops byte 0), and that text. A reply cut at a stop string keeps its streamed text."""
        ids = result.tokens[:-1] if result.stats.get("finish_reason") == "eos" else result.tokens
        text = self.tok.decode(ids)
        if text == result.text or result.stats.get("finish_reason") == "stop":
            return split, result.text
        again = Split(self.family, starts_in_reasoning(self.family, prompt_text))
        again.feed(text)
        again.finish()
        return again, text

    def _run(self, call: ToolCall) -> None:
        confirm = self.options.confirm
        if confirm is not None and call.name in self.options.toolbox.functions and not confirm(call):
            call.error = "the user declined this call"
            return
        self.options.toolbox.run(call)

    def _next_id(self) -> str:
        """Call ids as Mistral's template wants them (9 alphanumeric characters), numbered in the session."""
        self.calls_made += 1
        n = sum(len(m.get("tool_calls") or []) for m in self.conv.messages) + self.calls_made
        return f"call{n:05d}"

    def _grammar(self) -> str:
        """The grammar of a required call; reasoning before it leaves room for the call within max_tokens."""
        think = self.args.get(thinking_keyword(self.tok) or "", True) is not False
        n = self.max_tokens
        budget = max(n - CALL_ROOM, n // 2) if n else None
        return call_grammar(self.family, self.options.toolbox.schemas, self.tok.get_vocab(), think, budget)

    def _show(self, pieces: list) -> None:
        for channel, text in pieces:
            target = self.on_text if channel == "answer" else self.options.on_reasoning
            if target is not None:
                target(text)


def run_turn(sessions, generate, model, prompt: str, options: ChatOptions, params, request: dict, *,
             system: str | None):
    """A chat turn of `model` in request["session"] (None: a conversation of one turn, dated today).
    generate(model, ids, params, request) is the engine's one generation; a step under a required call
    follows the call's grammar instead of the request's constraint, without drafts (its reasoning's token
    bound is a llguidance lexeme that cannot roll back)."""
    from ..generate.grammars import constraint_of
    from .prompts import checked

    prompt = checked(prompt, system, model.config, request.get("truncate"))  # as encode_prompt checks a prompt
    session, on_text = request["session"], request.pop("on_text")
    conv = sessions.get_or_create(session, system=system, model=model.name) if session is not None else Session("")

    def step(ids: list, shown, call: str | None):
        if call is None:
            return generate(model, ids, params, dict(request, on_text=shown))
        return generate(model, ids, params, dict(request, on_text=shown, lookup=False, draft=False,
                                                 num_draft_tokens=None, constraint=constraint_of(model, None, None,
                                                                                                 None, call)))

    return Turn(model.tokenizer, conv, prompt, options, system=system, on_text=on_text,
                records=sessions.loops.opener(model.namespace, params.as_dict()), max_tokens=params.max_tokens).run(step)
