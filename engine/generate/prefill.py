"""Prefill: forwarding prompt tokens into caches in chunks, before the token loop (loop.py) takes over."""

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
