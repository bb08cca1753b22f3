"""A reply split as it streams: reasoning (Qwen3 / DeepSeek `<think>` blocks, gpt-oss's analysis
channel), the answer, and the text of tool calls (`<tool_call>` blocks, Mistral's `[TOOL_CALLS]`,
Llama's `<|python_tag|>`, gpt-oss's commentary to=functions.NAME), markers hidden.

`Split.feed(piece)` returns what to show of a streamed piece, as (channel, text) pairs: "reasoning"
or "answer" (tool-call text is kept for the parser, not shown). A piece that ends in what may be the
start of a marker is held back until the next one tells. What it gathered is `reasoning`, `answer`
and `calls` ([(recipient or None, text)]).
"""

from __future__ import annotations

from .templates import Family

HARMONY_MESSAGE, HARMONY_ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>")


def call_markers(family: Family) -> dict:
    """Markers that open and close a tool call's text in the family's output."""
    return {"hermes": {"<tool_call>": "call", "</tool_call>": "answer"}, "mistral": {"[TOOL_CALLS]": "call"},
            "llama3": {"<|python_tag|>": "call"}}.get(family.name, {})


def starts_in_reasoning(family: Family, prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the reply inside an open reasoning block (DeepSeek-R1's
    `<｜Assistant｜><think>\\n`, a template that opens the block for the model)."""
    if family.think is None:
        return False
    start, end = family.think
    return prompt_text.rfind(start) > prompt_text.rfind(end)


class Split:
    def __init__(self, family: Family, in_reasoning: bool = False):
        self.harmony = family.name == "harmony"
        self.markers = {} if self.harmony else dict(call_markers(family))
        if family.think and not self.harmony:
            self.markers.update({family.think[0]: "reasoning", family.think[1]: "answer"})
        self.channel = "header" if self.harmony else ("reasoning" if in_reasoning else "answer")
        self.pending = ""  # text not yet routed (a possible marker start)
        self.header = ""  # harmony: the header of the message being read
        self.parts: list[list] = []  # [channel, text, recipient] in order
        self.trim = False  # the newlines a template puts after a reasoning block are not the answer's

    # --- what was gathered ---

    def text_of(self, channel: str) -> str:
        return "".join(p[1] for p in self.parts if p[0] == channel)

    @property
    def reasoning(self) -> str:
        return self.text_of("reasoning")

    @property
    def answer(self) -> str:
        return self.text_of("answer")

    @property
    def calls(self) -> list[tuple]:
        return [(p[2], p[1]) for p in self.parts if p[0] == "call"]

    # --- streaming ---

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self.pending += piece
        return self._route(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._route(final=True)

    def _route(self, final: bool) -> list[tuple[str, str]]:
        shown: list[tuple[str, str]] = []
        while self.pending:
            marks = self._marks()
            at, mark = min(((self.pending.find(m), m) for m in marks if m in self.pending), default=(-1, None))
            if mark is None:
                keep = 0 if final else _partial(self.pending, marks)
                self._add(self.pending[: len(self.pending) - keep], shown)
                self.pending = self.pending[len(self.pending) - keep:]
                break
            self._add(self.pending[:at], shown)
            self.pending = self.pending[at + len(mark):]
            self._switch(mark)
        return shown

    def _marks(self) -> tuple:
        if not self.harmony:
            return tuple(self.markers)
        return (HARMONY_MESSAGE,) if self.channel == "header" else HARMONY_ENDS

    def _switch(self, mark: str) -> None:
        if not self.harmony:
            self.trim = self.channel == "reasoning" and self.markers[mark] == "answer"
            self.channel = self.markers[mark]
            if self.channel == "call":  # each opener starts a call of its own
                self.parts.append(["call", "", None])
            return
        if mark == HARMONY_MESSAGE:  # the header says where the body goes
            head, self.header = self.header, ""
            recipient = next((w[3:] for w in head.replace("<|channel|>", " ").split() if w.startswith("to=")), None)
            if recipient is not None and recipient.startswith("functions."):
                self.channel = "call"
                self.parts.append(["call", "", recipient[len("functions."):]])
            else:
                self.channel = "reasoning" if "<|channel|>analysis" in head else "answer"
        else:
            self.channel = "header"

    def _add(self, text: str, shown: list) -> None:
        if not text:
            return
        if self.channel == "header":
            self.header += text
            return
        if self.trim and self.channel == "answer":
            text, self.trim = text.lstrip("\n"), not text.strip("\n")
            if not text:
                return
        if self.parts and self.parts[-1][0] == self.channel:
            self.parts[-1][1] += text
        else:
            self.parts.append([self.channel, text, None])
        if self.channel in ("reasoning", "answer"):
            shown.append((self.channel, text))


def _partial(text: str, marks) -> int:
    """How many trailing characters of `text` may be the start of a marker."""
    return max((k for m in marks for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
