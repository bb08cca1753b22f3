"""A prompt as token ids: sent as it is (raw), one user turn through the model's chat template,
or a chat session's next turn (keeping the ids the model generated for earlier replies)."""

from __future__ import annotations

from ..generate.sampling import GenerationError


def encode_prompt(tok, prompt: str, *, system: str | None = None, raw: bool = False, session=None) -> list[int]:
    """tok: the model's tokenizer; session: a `sessions.Session`, or None."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise GenerationError("empty prompt: write the prompt in the cell (or pass a non-empty string)")
    if raw:
        bos = getattr(tok, "bos_token", None)
        return list(tok.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos))))
    if session is not None:
        messages = session.render_messages(prompt, system)
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if not getattr(tok, "chat_template", None):
        return list(tok.encode("\n".join(msg["content"] for msg in messages)))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if session is not None:  # keep the ids the model generated for earlier replies
        return session.encode_rendered(text, tok)
    return list(tok.encode(text, add_special_tokens=False))


def render_turn(tok, prompt: str, *, system: str | None = None) -> str:
    """One user turn through the chat template, up to where the assistant's reply begins (text)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    if not getattr(tok, "chat_template", None):
        return "\n".join(msg["content"] for msg in messages)
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
