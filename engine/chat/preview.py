"""Previews of cached prefixes: the text a person wrote, first, and what tells an entry apart.

A cached prefix decodes to the chat template's rendering: role markers,
and with some models (SmolLM2) a default system turn before every user
message. ``prefix_text`` drops both, using the template itself to learn
what they look like: it renders small conversations with sentinel contents
and keeps the text around the sentinels (the head before the first user
message, the separators between turns). Tokenizer only; no MLX.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from ..kv.tokens import token_key

__all__ = ["Previews", "TemplateShape", "prefix_text"]

_S = ["\x01mlxc-%d\x01" % i for i in range(4)]  # sentinel contents no template writes itself
_SHAPES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _render(tok, messages: list[dict], gen: bool = False) -> str | None:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    except Exception:  # a template that rejects this order of turns
        return None


def _between(text: str | None, a: str, b: str | None) -> str | None:
    """The text after sentinel ``a`` up to ``b`` (or the end); None when absent."""
    if text is None or a not in text:
        return None
    rest = text.split(a, 1)[1]
    if b is None:
        return rest
    return rest.split(b, 1)[0] if b in rest else None


class TemplateShape:
    """What a tokenizer's chat template writes around the contents of turns."""

    def __init__(self, tok):
        self.heads: list[str] = []  # text before the first content (longest first)
        self.separators: list[str] = []  # text between contents, and after the last one
        self.specials = sorted(_special_strings(tok), key=len, reverse=True)
        if not getattr(tok, "chat_template", None):
            return
        u, a, u2, s = _S
        user = _render(tok, [{"role": "user", "content": u}])
        system = _render(tok, [{"role": "system", "content": s}, {"role": "user", "content": u}])
        chat = _render(tok, [{"role": "user", "content": u}, {"role": "assistant", "content": a},
                             {"role": "user", "content": u2}], gen=True)
        heads = [h.split(x, 1)[0] for h, x in ((user, u), (system, s)) if h and x in h]
        seps = [_between(system, s, u), _between(chat, u, a), _between(chat, a, u2), _between(chat, u2, None),
                _between(user, u, None)]
        self.heads = sorted({h for h in heads if h}, key=len, reverse=True)
        self.separators = sorted({x for x in seps if x and x.strip()}, key=len, reverse=True)

    def clean(self, text: str) -> str:
        """Rendered text -> the contents of its turns, separated by ' · '."""
        for head in self.heads:
            if text.startswith(head):
                text = text[len(head):]
                break
        for sep in self.separators:
            text = text.replace(sep, " · ")
        for sp in self.specials:
            text = text.replace(sp, " ")
        return " ".join(text.split()).strip(" ·")


def _special_strings(tok) -> set[str]:
    found = set(getattr(tok, "all_special_tokens", None) or [])
    for t in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        if getattr(t, "special", False):
            found.add(str(t.content))
    return {s for s in found if s}


def shape_of(tok) -> TemplateShape:
    """The template shape of ``tok``, worked out once per tokenizer object."""
    try:
        shape = _SHAPES.get(tok)
    except TypeError:  # not weak-referenceable
        return TemplateShape(tok)
    if shape is None:
        shape = _SHAPES[tok] = TemplateShape(tok)
    return shape


def prefix_text(tok, tokens, max_tokens: int = 64) -> str:
    """The user's own text at the start of a prefix: default system turn and markers dropped.

    Decodes enough tokens to cover the template's head plus ``max_tokens``.
    """
    shape = shape_of(tok)
    extra = max((len(h) for h in shape.heads), default=0)  # characters: an upper bound on tokens
    ids = list(tokens[: max_tokens + extra])
    try:
        text = tok.decode(ids, skip_special_tokens=False)
    except TypeError:
        text = tok.decode(ids)
    cleaned = shape.clean(text)
    if cleaned or not text.strip():
        return cleaned
    return " ".join(tok.decode(ids, skip_special_tokens=True).split())


START, LIMIT = 20, 60  # characters of the start, and of a whole preview that parts from its neighbours
PARTS_MIN = 16  # tokens shared with a neighbour before its own text is worth showing


class Previews:
    """Previews of cached prefixes, remembered (decoding is what a listing spends its time on).

    `of(ns, tokens)` is the start of the prefix; with `parts_at` (where it parts from the entries
    most like it: kv/tokens.py's `parting_points`) it is the start, then what it says from there
    on, so twelve questions over one document read as twelve questions.
    """

    def __init__(self, tokenizer_of: Callable[[str], Any]):
        self.tokenizer_of = tokenizer_of  # namespace -> its loaded tokenizer, or None
        self._seen: dict = {}

    def of(self, ns: str, tokens, parts_at: int = 0, limit: int = 80) -> str:
        key = (ns, token_key(tokens), parts_at if parts_at >= PARTS_MIN else 0, limit)
        if key not in self._seen:
            tok = self.tokenizer_of(ns)
            if tok is None:
                return f"<{len(tokens)} tokens of an unloaded model>"
            if len(self._seen) > 4096:
                self._seen.clear()
            self._seen[key] = self._text(tok, tuple(tokens), key[2], limit)
        return self._seen[key]

    @staticmethod
    def _text(tok, tokens: tuple, at: int, limit: int) -> str:
        start, shape = prefix_text(tok, tokens), shape_of(tok)
        if not at or at >= len(tokens) or (at < 4 * limit and len(shape.clean(_decode(tok, tokens[:at]))) < limit - 20):
            return _clip(start, limit)  # (the start shows where it parts)
        before = _decode(tok, tokens[max(0, at - 8) : at])  # from the start of the word it parts in
        word = "" if not before or before[-1].isspace() else before.split()[-1] if before.split() else ""
        own = shape.clean(word + _decode(tok, tokens[at : at + LIMIT]))
        return start[:START].rstrip() + " … " + _clip(own, LIMIT - START - 3)


def _decode(tok, ids) -> str:
    try:
        return tok.decode(list(ids), skip_special_tokens=False)
    except TypeError:
        return tok.decode(list(ids))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
