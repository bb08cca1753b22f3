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
        self.last_prompt_tokens = len(prompt_ids)
        self.history = [(list(prompt_ids) + list(generated_ids), None), (list(prompt_ids), None)]

    def encode_rendered(self, text: str, tokenizer) -> list[int]:
        """Token ids for the rendered conversation `text`.

        The ids the model generated are not always how the tokenizer would
        encode their text: re-encoding the previous reply would make the
        cache miss from the first different token (and a recurrent model from
        the prompt boundary). So when the rendering starts with exactly the
        text of the last turn's ids (reply included, else prompt only), those
        ids are kept and only the rest is encoded; the result must decode to
        `text`, or the canonical encoding is used.
        """
        for i, (ids, known) in enumerate(self.history):
            prefix = known if known is not None else tokenizer.decode(ids)
            self.history[i] = (ids, prefix)
            if ids and text.startswith(prefix):
                rest = text[len(prefix):]
                full = ids + (list(tokenizer.encode(rest, add_special_tokens=False)) if rest else [])
                if tokenizer.decode(full) == text:
                    return full
        return list(tokenizer.encode(text, add_special_tokens=False))

    @property
    def turns(self) -> int:
        return len(self.messages) // 2

    def summary(self) -> dict:
        return {
            "id": self.id,
            "model": self.model,
            "system": self.system,
            "turns": self.turns,
            "last_prompt_tokens": self.last_prompt_tokens,
        }


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


class Sessions:
    """Chat sessions by id (`eng.sessions`): each one's history here; its latest state in the cache's
    session index, which `switch` brings back into RAM and `close` lets go of."""

    def __init__(self, *, cache, models, events, poll: Callable[[], None]):
        """cache: the engine's TieredPromptCache; models: its ModelRegistry; poll: apply finished
        background work (the engine's)."""
        self._sessions: dict[str, Session] = {}
        self.cache, self.models, self.events, self.poll = cache, models, events, poll

    def new(self, session_id: str, *, system: str | None = None, model: str | None = None) -> Session:
        check_session_id(session_id)
        if session_id in self._sessions:
            raise SessionError(f"session {session_id!r} already exists (reset or close it first)")
        s = self._sessions[session_id] = Session(session_id, system, model)
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
        s.last_prompt_tokens = 0
        s.history = []
        s.images = []
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
