"""A prompt as token ids: sent as it is (raw), one user turn through the model's chat template,
or a chat session's next turn (keeping the ids the model generated for earlier replies). A whole
chat turn, with template options, reasoning and tools, is turn.py's."""

from __future__ import annotations

from ..generate.sampling import GenerationError
from .templates import render


def encode_prompt(tok, prompt: str, *, system: str | None = None, raw: bool = False, session=None) -> list[int]:
    """tok: the model's tokenizer; session: a `sessions.Session`, or None."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise GenerationError("empty prompt: write the prompt in the cell (or pass a non-empty string)")
    if raw:
        bos = getattr(tok, "bos_token", None)
        return list(tok.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos))))
    if session is not None:
        text = render(tok, session.render_messages(prompt, system), options=session.template_args, clock=session.clock)
        return session.encode_rendered(text, tok)  # keep the ids the model generated for earlier replies
    # (without a template the text is plain, and takes the tokenizer's special tokens)
    return list(tok.encode(render_turn(tok, prompt, system=system), add_special_tokens=not getattr(tok, "chat_template", None)))


def render_turn(tok, prompt: str, *, system: str | None = None) -> str:
    """One user turn through the chat template, up to where the assistant's reply begins (text)."""
    return render(tok, ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}])
