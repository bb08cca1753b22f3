"""A prompt as token ids: sent as it is (raw), one user turn through the model's chat template,
or a chat session's next turn (keeping the ids the model generated for earlier replies). A whole
chat turn, with template options, reasoning and tools, is turn.py's."""

from __future__ import annotations

from ..generate.sampling import GenerationError
from ..generate.window import MAX_CHARS_PER_TOKEN, check_truncate, cut, window_of
from .templates import render


def encode_prompt(tok, prompt: str, *, system: str | None = None, raw: bool = False, session=None,
                  config: dict | None = None, truncate: str | None = None) -> list[int]:
    """tok: the model's tokenizer; session: a `sessions.Session`, or None. config: the model's, whose
    window bounds the text (generate/window.py): a prompt of more characters than it could hold is
    refused before it is tokenized, or cut as `truncate` says (then its tokens are cut to fit)."""
    prompt = checked(prompt, system, config, truncate)
    if raw:
        bos = getattr(tok, "bos_token", None)
        return list(tok.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos))))
    if session is not None:
        text = render(tok, session.render_messages(prompt, system), options=session.template_args, clock=session.clock)
        return session.encode_rendered(text, tok)  # keep the ids the model generated for earlier replies
    # (without a template the text is plain, and takes the tokenizer's special tokens)
    plain = not getattr(tok, "chat_template", None)
    return list(tok.encode(render_turn(tok, prompt, system=system), add_special_tokens=plain))


def checked(prompt: str, system: str | None, config: dict | None, truncate: str | None) -> str:
    """The prompt, refused when empty or not encodable, bounded by the model's window (`bounded`)."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise GenerationError("empty prompt: write the prompt in the cell (or pass a non-empty string)")
    encodable(prompt, "the prompt")
    encodable(system, "the system prompt")
    return bounded(prompt, config, truncate)


def bounded(text: str, config: dict | None, truncate: str | None, what: str = "prompt") -> str:
    """`text`, unless it has more characters than a prompt for a model with this config could
    hold (MAX_CHARS_PER_TOKEN a token of its window): then refused, or cut as `truncate` says."""
    window = window_of(config or {})
    limit = None if window is None else window * MAX_CHARS_PER_TOKEN
    if limit is None or len(text) <= limit:
        return text
    if check_truncate(truncate) is not None:
        return cut(text, limit, truncate)
    raise GenerationError(f"{what} of {len(text):,} characters cannot fit a window of {window:,} tokens (at most "
                          f"{limit:,} characters, {MAX_CHARS_PER_TOKEN} a token): refused before tokenizing it; "
                          "shorten it, or pass truncate='left' or 'middle' (--truncate) to cut it knowingly")


def encodable(text: str | None, what: str) -> str | None:
    """`text`, if a tokenizer can encode it; else one line naming the character and where it is.
    A lone surrogate (half of a UTF-16 pair: a bad decode, a cut emoji) is not text: the
    tokenizer refuses it with a TypeError of its own."""
    try:
        if text is not None:
            text.encode("utf-8")
    except UnicodeEncodeError as e:
        line, col = text.count("\n", 0, e.start) + 1, e.start - text.rfind("\n", 0, e.start)
        raise GenerationError(f"{what} cannot be encoded: character U+{ord(text[e.start]):04X} (a lone surrogate, "
                              f"half of a UTF-16 pair) at position {e.start} (line {line}, column {col}); remove "
                              "it, or decode the text with errors='replace'") from None
    return text


def render_turn(tok, prompt: str, *, system: str | None = None) -> str:
    """One user turn through the chat template, up to where the assistant's reply begins (text)."""
    return render(tok, ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}])
