"""Chat sessions (`eng.sessions`): conversation history per session id.

The cache keeps its own session index (session id -> latest checkpoint);
this module keeps what the user said and what the model answered, so each
turn renders the whole conversation with the chat template. `Sessions.switch`
brings a session's latest state back into RAM; `close` forgets the session and
the index's references to it (the cached states stay).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..named.names import check_user_name
from ..errors import SessionError  # noqa: F401 (raised here; defined in errors.py)


def check_session_id(session_id: str) -> str:
    return check_user_name(session_id, "session id", SessionError)


@dataclass
class Session:
    id: str
    system: str | None = None
    model: str | None = None
    messages: list = field(default_factory=list)  # {"role", "content"}: a string, or parts with images
    images: list = field(default_factory=list)  # a VLM conversation's images, Clips and Recordings, in order
    created: float = field(default_factory=time.time)
    last_prompt_tokens: int = 0
    # Provenance: the token ids of the last turn's prompt and of prompt +
    # generated reply, with their decoded text once known.
    history: list = field(default_factory=list, repr=False)  # [(ids, text or None)], longest first
    template_args: dict = field(default_factory=dict)  # the template keywords its turns render with
    clock: float | None = None  # the time its template's dates render at (pinned when it is created)
    # Each reply in history[0]: (turn, where it starts, where it ends, its reasoning, reasoning tokens), for `note`
    marks: list = field(default_factory=list, repr=False)
    reused: int = field(default=0, repr=False)  # how many of history[0]'s ids the last encoding kept
    note: str | None = None  # why the last encoding did not keep every id of the history, in words

    def render_messages(self, user_text: str, system: str | None = None, images: int = 0, videos: int = 0,
                        audios: int = 0) -> list:
        system = system if system is not None else self.system
        head = [{"role": "system", "content": system}] if system else []
        return head + self.messages + [{"role": "user", "content": user_content(user_text, images, videos, audios)}]

    def record_turn(self, user_text: str, reply: str, prompt_ids: list, generated_ids: list,
                    images: list | tuple = ()) -> None:
        from ..media.audio import Recording
        from ..media.video import Clip

        clips = sum(1 for x in images if isinstance(x, Clip))
        recs = sum(1 for x in images if isinstance(x, Recording))  # the rest are images
        self.messages += [
            {"role": "user", "content": user_content(user_text, len(images) - clips - recs, clips, recs)},
            {"role": "assistant", "content": reply},
        ]
        self.images += list(images)
        self.remember(prompt_ids, generated_ids, self.turns)

    def remember(self, prompt_ids: list, generated_ids: list, turn: int, reasoning: str = "",
                 reasoning_tokens: int = 0) -> None:
        """The ids of a reply of user turn `turn` that the model generated after `prompt_ids` (provenance
        for the next encoding), and how much reasoning it holds."""
        start = len(prompt_ids)
        self.marks = [m for m in self.marks if m[2] <= self.reused] + [
            (turn, start, start + len(generated_ids), reasoning, reasoning_tokens)]
        self.last_prompt_tokens = len(prompt_ids)
        self.history = [(list(prompt_ids) + list(generated_ids), None), (list(prompt_ids), None)]

    def encode_rendered(self, text: str, tokenizer) -> list[int]:
        """Token ids for the rendered conversation `text`.

        The ids the model generated are not always how the tokenizer would
        encode their text: re-encoding the previous reply would make the
        cache miss from the first different token (and a recurrent model from
        the prompt boundary). So the longest run of the last turn's ids
        (prompt and reply) whose text starts the rendering is kept and only
        the rest is encoded; the result must decode to `text`, or the
        canonical encoding is used. Where the template rewrote what the
        history holds (it dropped a reply's reasoning, re-rendered a call),
        the ids are kept up to the first change and `note` says why.
        """
        self.note, self.reused = None, 0
        if not getattr(tokenizer, "chat_template", None):  # plain text, with the tokenizer's special tokens
            return list(tokenizer.encode(text))
        for i, (ids, known) in enumerate(self.history):
            prefix = known if known is not None else tokenizer.decode(ids)
            self.history[i] = (ids, prefix)
            keep = len(ids) if text.startswith(prefix) else _kept(ids, text, tokenizer)
            if not keep:
                continue
            head = prefix if keep == len(ids) else tokenizer.decode(ids[:keep])
            rest = text[len(head):]
            full = ids[:keep] + (list(tokenizer.encode(rest, add_special_tokens=False)) if rest else [])
            if tokenizer.decode(full) == text:
                if i == 0:
                    self.reused = keep
                    self.note = None if keep == len(ids) else self._why(keep, text)
                return full
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _why(self, keep: int, text: str) -> str:
        """Why the rendering departs from the history at token `keep`, in words for the footer."""
        def label(m) -> str:  # a reply: "turn 2's reply", or "step 3 of turn 2" inside a tool loop
            steps = [x for x in self.marks if x[0] == m[0]]
            return f"step {steps.index(m) + 1} of turn {m[0]}" if len(steps) > 1 else f"turn {m[0]}'s reply"

        inside = next((m for m in self.marks if m[1] <= keep < m[2]), None)
        if inside is not None:
            dropped = sum(m[4] for m in self.marks if m[0] == inside[0] and m[3].strip() and m[3].strip() not in text)
            if dropped:
                return f"the template dropped {dropped} reasoning tokens of turn {inside[0]}"
            return f"the template rewrote {label(inside)} from its token {keep - inside[1]}"
        ended = [m for m in self.marks if m[2] <= keep]
        if ended:  # after a reply: tool results, a generation prompt (an earlier step's place is not kept)
            last = ended[-1]
            steps = sum(1 for m in self.marks if m[0] == last[0])
            return (f"the template rewrote what followed turn {last[0]}'s reply" if steps == 1 and last is self.marks[-1]
                    else f"the template re-rendered what followed a reply of turn {last[0]} (a tool result, its glue)")
        return f"the template rewrote the conversation from token {keep}"

    def record(self) -> dict:
        """What a named checkpoint keeps of the session (JSON)."""
        return {"id": self.id, "system": self.system, "messages": self.messages, "template_args": self.template_args,
                "clock": self.clock}

    def restore(self, record: dict, tokens: list) -> None:
        """The chat a named checkpoint kept, at its state's `tokens`."""
        self.system, self.messages = record.get("system"), [dict(x) for x in record["messages"]]
        self.template_args, self.clock = dict(record.get("template_args") or {}), record.get("clock", self.clock)
        self.last_prompt_tokens, self.marks = len(tokens), []
        self.history = [(list(tokens), None)]  # the next turn keeps these ids where the text matches

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "user")

    def summary(self) -> dict:
        return {
            "id": self.id,
            "model": self.model,
            "system": self.system,
            "turns": self.turns,
            "last_prompt_tokens": self.last_prompt_tokens,
        }


def _kept(ids: list, text: str, tokenizer) -> int:
    """How many leading `ids` decode to a beginning of `text` (binary search: fewer decode to less)."""
    lo, hi = 0, len(ids)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if text.startswith(tokenizer.decode(ids[:mid])):
            lo = mid
        else:
            hi = mid
    return lo


def user_content(text: str, images: int, videos: int = 0, audios: int = 0) -> str | list:
    """A user turn: the text, or (a VLM turn) its images first, then its videos and recordings, then the text."""
    if not images and not videos and not audios:
        return text
    return ([{"type": "image"}] * images + [{"type": "video"}] * videos + [{"type": "audio"}] * audios
            + [{"type": "text", "text": text}])


def shown(content: str | list) -> str:
    """A turn's content as text: its images as [image], videos as [video], recordings as [audio], then its text."""
    if isinstance(content, str):
        return content
    return " ".join(f"[{part['type']}]" if part.get("type") in ("image", "video", "audio") else part.get("text", "")
                    for part in content)


def shown_message(msg: dict) -> str:
    """A message as `%session show` prints it: its content, its tool calls and how long its reasoning was."""
    calls = [c.get("function", c) for c in msg.get("tool_calls") or []]
    thought = next((msg[k] for k in ("reasoning_content", "thinking") if msg.get(k)), "")
    return (shown(msg.get("content") or "") + "".join(
        f" -> {c['name']}({', '.join(f'{k}={v!r}' for k, v in (c.get('arguments') or {}).items())})" for c in calls)
            + (f" (thought {len(thought.split())} words)" if thought else ""))


class Sessions:
    """Chat sessions by id (`eng.sessions`): each one's history here; its latest state in the cache's
    session index, which `switch` brings back into RAM and `close` lets go of."""

    def __init__(self, *, cache, models, events, poll: Callable[[], None], loops=None):
        """cache: the engine's TieredPromptCache; models: its ModelRegistry; poll: apply finished
        background work (the engine's); loops: where agent loops keep their crash records (None: nowhere)."""
        from .loops import LoopRecords

        self._sessions: dict[str, Session] = {}
        self.cache, self.models, self.events, self.poll = cache, models, events, poll
        self.loops = LoopRecords(loops)

    def new(self, session_id: str, *, system: str | None = None, model: str | None = None,
            template_args: dict | None = None) -> Session:
        """template_args: the chat-template keywords its turns render with (generate's update them)."""
        check_session_id(session_id)
        if session_id in self._sessions:
            raise SessionError(f"session {session_id!r} already exists (reset or close it first)")
        s = self._sessions[session_id] = Session(session_id, system, model, template_args=dict(template_args or {}))
        s.clock = s.created  # its template's dates stay those of the day it was created
        return s

    def get(self, session_id: str) -> Session:
        if session_id not in self._sessions:
            known = ", ".join(sorted(self._sessions)) or "none"
            raise SessionError(f"unknown session {session_id!r}; sessions: {known}")
        return self._sessions[session_id]

    def get_or_create(self, session_id: str, *, system: str | None = None, model: str | None = None) -> Session:
        check_session_id(session_id)
        if session_id not in self._sessions:
            return self.new(session_id, system=system, model=model)
        return self._sessions[session_id]

    def reset(self, session_id: str) -> Session:
        """Forget the conversation, keep the session (its cached states stay in the cache)."""
        s = self.get(session_id)
        s.messages.clear()
        s.last_prompt_tokens, s.reused, s.note = 0, 0, None
        s.history, s.marks, s.images = [], [], []
        return s

    def close(self, session_id: str) -> Session:
        """Forget a chat session and the cache's references to it; the cached states stay."""
        s = self.get(session_id)
        del self._sessions[session_id]
        self.cache.drop_session(session_id)
        return s

    def switch(self, session_id: str, *, model: str | None = None) -> dict:
        """Bring a chat session's latest state back into RAM, in the background when it is on
        SSD only; returns at once: {"session", "tokens", "source": "ram" | "loading" | None}."""
        s = self.get(session_id)
        ns = self.models.get(s.model or model).namespace
        entry = self.cache.session_entry(s.id, ns)
        if entry is not None:
            return {"session": s.id, "tokens": len(entry.tokens), "source": "ram"}
        ids = s.history[0][0] if s.history else []
        if not ids:
            return {"session": s.id, "tokens": 0, "source": None}
        self.poll()
        source, n = self.cache.load(ids, ns, exact=False, then=lambda e: self.cache.bind_session(s.id, e))
        self.events.emit("session_switched", session=s.id, tokens=n, source=source)
        return {"session": s.id, "tokens": n if source else 0, "source": source}

    def entry(self, session_id: str, *, model: str | None = None):
        """The session's latest cache entry (waiting for a `switch` that is loading it); a ValueError
        when it has none yet."""
        s = self.get(session_id)
        ns = self.models.get(s.model or model).namespace
        entry = self.cache.session_entry(session_id, ns)
        if entry is None and self.cache.loading.reader is not None and self.cache.loading.reader.jobs():
            self.cache.loading.wait_reads(30)  # a `switch` may be loading it
            entry = self.cache.session_entry(session_id, ns)
        if entry is None:
            raise ValueError(f"session {session_id!r} has no cached state yet: generate in it first")
        return entry

    def list(self) -> list[Session]:
        return list(self._sessions.values())

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions
