"""The model's window: the positions it was trained for, and prompts that do not fit in it.

A prompt longer than the window, or one that leaves no room for `max_tokens` (prompt +
max_tokens > window, as vLLM counts), is refused before any work, with one line naming both
numbers (GenerationError). `truncate` lets a caller go on knowingly: "left" drops the oldest
tokens (the end is kept: the question, the generation prompt), "middle" keeps the start (a
system prompt, the template's header) and the end and drops what lies between. The same rule
holds for score() contexts, each row of a batch, a chat session that has grown past the window
(its oldest turns must go). A text of more characters than a prompt could hold (MAX_CHARS_PER_TOKEN
a token of the window: chat/prompts.py `bounded`, and the magics' `{var}` values) is refused before
it is tokenized, or cut as characters first.

The window is the config's `max_position_embeddings` (or the other names configs use for it),
that of `text_config` for a vision-language model, times a YaRN / linear / dynamic
`rope_scaling` factor where the config names the original window it extends. None where the
config says nothing: then nothing is refused.
"""

from __future__ import annotations

from typing import Sequence

from ..errors import GenerationError

TRUNCATE = ("left", "middle")
WINDOW_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length", "n_ctx")
MAX_CHARS_PER_TOKEN = 16  # a {var} longer than window * this many characters cannot fit (text averages 3-5)


def window_of(config: dict) -> int | None:
    """The positions a model with this config attends over (None: the config does not say)."""
    for cfg in (config, config.get("text_config") or {}):
        found = next((int(cfg[k]) for k in WINDOW_KEYS if isinstance(cfg.get(k), (int, float)) and cfg[k] > 0), None)
        if found is None:
            continue
        scaling = cfg.get("rope_scaling") or {}
        original, factor = scaling.get("original_max_position_embeddings"), scaling.get("factor")
        if original and factor and (scaling.get("type") or scaling.get("rope_type")) in ("yarn", "linear", "dynamic"):
            found = max(found, int(original * factor))
        return found
    return None


def check_truncate(truncate) -> str | None:
    if truncate is not None and truncate not in TRUNCATE:
        raise GenerationError(f"truncate must be 'left' or 'middle' (or None: refuse what does not fit), "
                              f"got {truncate!r}")
    return truncate


def cut(items: Sequence, keep: int, how: str) -> Sequence:
    """`items` (token ids, or a string) cut to `keep` of them: the last ones ("left"), or the first
    half and the last ("middle")."""
    if len(items) <= keep:
        return items
    if how == "left" or keep < 2:
        return items[len(items) - keep:] if keep > 0 else items[:0]
    head = keep // 2
    return items[:head] + items[len(items) - (keep - head):]


def fit(model, tokens: list, room: int, truncate: str | None, *, what: str = "prompt",
        session: str | None = None, room_name: str = "max_tokens") -> tuple[list, int]:
    """(tokens, how many were dropped): `tokens` and `room` more positions (max_tokens) fit the
    window of `model` (a LoadedModel), else GenerationError, or cut as `truncate` says."""
    window = model.context_window
    if window is None or len(tokens) + room <= window:
        return tokens, 0
    if check_truncate(truncate) is not None and window - room > 0:
        return list(cut(tokens, window - room, truncate)), len(tokens) - (window - room)
    n, name = len(tokens), f"the window of model {model.name!r} ({window:,} tokens)"
    need = f"{n:,} tokens" + (f" + {room_name} {room:,}" if room else "")
    if room >= window:
        raise GenerationError(f"{what}: {room_name} {room:,} leave no room in {name}: lower it")
    if session is not None:
        raise GenerationError(f"session {session!r} has grown to {need}, past {name}: its oldest turns must go "
                              f"(%session reset {session}, or truncate='left' (--truncate left) to drop the "
                              f"oldest {n + room - window:,} tokens)")
    lower = f"lower {room_name} to {window - n:,}, " if room and n < window else ""
    raise GenerationError(f"{what} of {need} does not fit {name}: {lower}shorten it, or pass truncate='left' or "
                          f"'middle' (--truncate) to drop {n + room - window:,} tokens knowingly")


def max_chars(model) -> int | None:
    """The longest text a `{var}` may hold for `model` (None: its window is unknown)."""
    window = model.context_window
    return None if window is None else window * MAX_CHARS_PER_TOKEN
