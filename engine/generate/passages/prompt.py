"""The prompt a list of passages makes, and where each passage's tokens are in it.

The passages go, in the order given, before the prompt's text, each followed by a blank line:
the user text is `"\\n\\n".join(passages) + "\\n\\n" + prompt`, and the prompt's token ids are
exactly what `generate` encodes for that text (the chat template, or raw): a full prefill of
them is the computation that placing the passages approximates. A tokenizer may encode a
passage's last blank line differently alone than before more text (SmolLM2's: one token at
the end of a text, two before a word), so the passages are not tokenized apart: the whole text
is, and each passage's tokens are the ones whose characters start inside it (the fast
tokenizer's offsets). Its blank line belongs to it; in any order, before any text that starts
with a word, a passage has the same tokens, and so the same stored KV.

The lead-in, after which every passage's KV is computed on its own, is what the template puts
before the user's text when there is no system prompt (raw: the tokenizer's BOS, or nothing):
fixed for a model, short, and the first tokens most attention goes to.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...chat.prompts import encode_prompt, render_turn
from ...errors import PassageError

SEPARATOR = "\n\n"


@dataclass
class PassagePrompt:
    tokens: list  # the prompt's token ids
    spans: list  # (start, end) token positions of each passage, its blank line included, in order
    lead_in: list  # the token ids each passage's KV is computed after


def as_passages(passages) -> list[str]:
    """A list of strings from a list, tuple, pandas Series or DataFrame column (a one-column DataFrame too)."""
    if isinstance(passages, str):
        raise PassageError("passages: a list of strings, not one string (wrap it: passages=[text])")
    columns = getattr(passages, "columns", None)
    if columns is not None:  # a DataFrame: its one column
        if len(columns) != 1:
            raise PassageError(f"passages: a DataFrame with {len(columns)} columns; pass one column (df['text'])")
        passages = passages[columns[0]]
    try:
        items = list(passages.tolist() if hasattr(passages, "tolist") else passages)
    except TypeError:
        raise PassageError(f"passages: a list of strings, not {type(passages).__name__}") from None
    if not items:
        raise PassageError("passages: the list is empty (leave passages out for a plain prompt)")
    for i, p in enumerate(items):
        if not isinstance(p, str) or not p.strip():
            what = "empty" if isinstance(p, str) else f"of type {type(p).__name__}"
            raise PassageError(f"passages[{i}] is {what}: every passage is a non-empty string")
    return items


def _text(tok, user_text: str, system: str | None, raw: bool) -> tuple[str, int, bool]:
    """The text the prompt's tokens encode, where the user text starts in it, and whether the
    encoding adds the tokenizer's special tokens (as chat/prompts.py encodes)."""
    if raw:
        bos = getattr(tok, "bos_token", None)
        return user_text, 0, not (bos and user_text.startswith(bos))
    text = render_turn(tok, user_text, system=system)
    at = text.rfind(user_text)
    if at < 0:
        raise PassageError("the chat template changes the text of the passages (it trims or rewrites the user "
                           "turn): use raw=True, or put the passages in the prompt")
    return text, at, not getattr(tok, "chat_template", None)


def _offsets(tok, text: str, special: bool) -> tuple[list, list]:
    hf = getattr(tok, "_tokenizer", tok)
    try:
        enc = hf(text, add_special_tokens=special, return_offsets_mapping=True)
    except (TypeError, NotImplementedError, ValueError) as e:
        raise PassageError(f"the model's tokenizer gives no character offsets ({e}): passages need a fast "
                           "tokenizer (tokenizer.json); put them in the prompt instead") from None
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _boundary(offsets: list, x: int) -> int:
    """How many tokens come before character x: those starting before it, and zero-width ones (special
    tokens) at or before it."""
    return sum(1 for s, e in offsets if s < x or (s == e and s <= x))


def passage_prompt(tok, prompt: str, passages: list[str], *, system: str | None = None,
                   raw: bool = False) -> PassagePrompt:
    """The prompt's tokens with each passage's span (tok: the model's tokenizer)."""
    user_text = "".join(p + SEPARATOR for p in passages) + prompt
    text, at, special = _text(tok, user_text, system, raw)
    ids, offsets = _offsets(tok, text, special)
    tokens = encode_prompt(tok, user_text, system=system, raw=raw)
    if ids != tokens:
        raise PassageError("the tokenizer's offsets do not match the prompt's tokens: put the passages in the prompt")
    spans, start = [], at
    for i, p in enumerate(passages):
        end = start + len(p) + len(SEPARATOR)
        span = (_boundary(offsets, start), _boundary(offsets, end))
        if span[1] <= span[0] or (spans and span[0] != spans[-1][1]):
            raise PassageError(f"passages[{i}] has no tokens of its own in the prompt (the tokenizer merges it "
                               "with its neighbours): put the passages in the prompt")
        spans.append(span)
        start = end
    return PassagePrompt(tokens, spans, lead_in(tok, raw))


def lead_in(tok, raw: bool) -> list:
    """What the prompt holds before the user's text with no system prompt: each passage's KV is computed
    after these tokens."""
    text, at, special = _text(tok, "Z", None, raw)
    ids, offsets = _offsets(tok, text, special)
    return ids[: _boundary(offsets, at)]


def check_window(m, pp: PassagePrompt) -> None:
    """A passage must fit the model's window after the lead-in (PassageError naming the passage)."""
    window = m.context_window
    if not window:
        return
    for i, (s, e) in enumerate(pp.spans):
        if len(pp.lead_in) + e - s > window:
            raise PassageError(f"passages[{i}] is {e - s} tokens, longer than the model's {window}-token window "
                               f"(after a {len(pp.lead_in)}-token lead-in): split it into shorter passages")
