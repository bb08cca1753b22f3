"""Streaming text: incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Sequence


class TextStream:
    """Incremental detokenization with stop strings.

    `add(token)` returns the newly visible text (held back while it could be
    the start of a stop string) and sets `stopped` when a stop string appears.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stop = tuple(stop)
        self.emitted = ""
        self.stopped = False

    def _full(self) -> str:
        return self.detok.text

    def add(self, token: int) -> str:
        self.detok.add_token(token)
        return self._advance(self._full())

    def finish(self) -> str:
        self.detok.finalize()
        return self._advance(self._full(), final=True)

    def _advance(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        for s in self.stop:
            i = text.find(s)
            if i >= 0:
                text, self.stopped = text[:i], True
        visible = text
        if not self.stopped and not final:  # hold back a possible stop-string start
            hold = max(
                (k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])),
                default=0,
            )
            visible = text[: len(text) - hold]
        new = visible[len(self.emitted) :] if visible.startswith(self.emitted) else ""
        self.emitted = visible if visible.startswith(self.emitted) else self.emitted
        return new

    @property
    def text(self) -> str:
        return self.emitted
