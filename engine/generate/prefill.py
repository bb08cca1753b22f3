"""Prefill: forwarding prompt tokens into caches in chunks, before the token loop (loop.py) takes over;
and a prompt of text tokens as a generation prefills it (`TextPrompt`)."""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx


def prefill(
    model,
    caches: list,
    tokens: Sequence[int],
    *,
    chunk: int,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Forward `tokens` into `caches` in chunks (no logits are kept); `progress(done, total)` before the
    first chunk (a display can show what the cell does from its first second) and after each."""
    total = len(tokens)
    if progress is not None and total:
        progress(0, total)
    for start in range(0, total, chunk):
        model(mx.array(tokens[start : start + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
        if progress is not None:
            progress(min(start + chunk, total), total)


class TextPrompt:
    """A prompt of text tokens, as the generation sees any prompt (media/prompt.py's MediaPrompt is the
    other kind: image, video and audio features merged into the embedding, their positions). model: a
    LoadedModel."""

    joins_first_step = True  # a short rest may go in one forward with the first decode step

    def __init__(self, model, tokens: list):
        self.forward, self.tokens = model.forward, tokens

    def prefill(self, caches: list, start: int, end: int, *, chunk: int, progress=None) -> None:
        prefill(self.forward, caches, self.tokens[start:end], chunk=chunk, progress=progress)

    def cut(self, n: int) -> int:
        return n  # any length of text is a state

    def stats(self, cached: int, source: str | None) -> dict:
        return {}
