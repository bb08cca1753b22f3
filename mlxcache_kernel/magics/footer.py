"""What ``%%generate`` returns and how it shows: ``CellResult``, its footer in
words (text/plain, the same in a terminal, a saved notebook or a headless run)
and as a picture (text/html: one thin bar split into the prompt tokens that
came from RAM, SSD, the remote tier or were prefilled, with the TTFT and the
decode speed after it). Inline HTML/CSS, no front-end build.
"""

from __future__ import annotations

import html
import math

from .constrain import constraint_phrase
from .chat import steps_phrase
from .tables import fmt_s, format_bytes

__all__ = ["CellResult", "SPANS", "footer_spans", "footer_html"]

# (key, label, colour) in the order the prompt is laid out: cached first, then prefilled
SPANS = (("ram", "RAM", "#2e7d32"), ("ssd", "SSD", "#1565c0"), ("remote", "remote", "#8e24aa"),
         ("passages", "from passages", "#00897b"), ("prefilled", "prefilled", "#ef6c00"))


def footer_spans(stats: dict) -> dict[str, int]:
    """Prompt tokens per source: ram, ssd, remote (``cached_tokens`` when the source is remote), placed from
    passages' KV, prefilled."""
    n = int(stats.get("prompt_tokens") or 0)
    remote = int(stats.get("remote_tokens") or 0)
    return {"ram": int(stats.get("ram_tokens") or 0), "ssd": int(stats.get("ssd_tokens") or 0), "remote": remote,
            "passages": int(stats.get("passage_tokens_placed") or 0),
            "prefilled": int(stats.get("prefilled_tokens", n) or 0)}


def footer_html(stats: dict, words: str) -> str:
    """The bar, a legend with the TTFT and tok/s after it, and the words below (all escaped)."""
    spans = footer_spans(stats)
    total = sum(spans.values()) or 1
    bar, legend = [], []
    for key, label, colour in SPANS:
        n = spans[key]
        if not n:
            continue
        pct = 100.0 * n / total
        bar.append(f"<span class='mlxc-span mlxc-span-{key}' data-tokens='{n}' title='{n} {label}' "
                   f"style='display:inline-block;height:100%;width:{pct:.3f}%;background:{colour}'></span>")
        legend.append(f"<span style='color:{colour}'>&#9632;</span> {n} {html.escape(label)}")
    tps = stats.get("decode_tokens_per_s")
    speed = f"TTFT {fmt_s(stats.get('ttft_s'))}" + (f" · {tps:.1f} tok/s" if tps else "")
    return (
        "<div class='mlxc-footer' style='font-size:85%;color:#666;border-top:1px solid #ddd;padding-top:3px'>"
        "<div style='display:flex;align-items:center;gap:8px;flex-wrap:wrap'>"
        "<span class='mlxc-footer-bar' style='display:inline-flex;width:240px;height:6px;border-radius:3px;"
        f"overflow:hidden;background:#e0e0e0'>{''.join(bar)}</span>"
        f"<span class='mlxc-footer-legend'>{' '.join(legend)}</span>"
        f"<span class='mlxc-footer-speed'>{html.escape(speed)}</span></div>"
        + "".join(f"<div class='mlxc-footer-{'why' if i else 'text'}'>{html.escape(line)}</div>"
                  for i, line in enumerate(words.split("\n"))) + "</div>"
    )


_TIERS = {"ram": "RAM", "ssd": "SSD", "remote": "remote"}
STOPS = {"eos": "ended (end-of-sequence token)", "stop": "stopped at a stop string",
         "length": "stopped at max tokens", "interrupted": "interrupted"}  # finish_reason in words


def context_phrase(prompt: int, decoded: int, window) -> str | None:
    """How much of the model's context window the conversation fills, e.g. "context 1,672 of 8,192"."""
    if not window:
        return None
    used = prompt + decoded
    return f"context {used:,} of {int(window):,} tokens" + (" (past the window)" if used > window else "")


def speed_phrase(s: dict) -> str | None:
    """The prompt's prefill rate and the peak memory, e.g. "prefill 96 tok/s · peak 612.0 MiB"."""
    rate, peak = s.get("prefill_tokens_per_s"), s.get("peak_memory_bytes")
    bits = ([f"prefill {rate:,.0f} tok/s"] if rate and (s.get("prefilled_tokens") or 0) > 1 else []) + (
        [f"peak memory {format_bytes(peak)}"] if peak else [])
    return " · ".join(bits) or None


def images_phrase(sources: list, noun: str = "image") -> str:
    """Where each image (or video) came from, e.g. "2 images: in the cached prefix (RAM), encoded"."""
    words = []
    for s in sources:
        if s.startswith("prefix:"):
            words.append(f"in the cached prefix ({_TIERS.get(s[7:], s[7:])})")
        elif s == "encoder":
            words.append("encoded")
        else:
            words.append(f"encoder output from {_TIERS.get(s, s)}")
    return f"{len(sources)} {noun}{'' if len(sources) == 1 else 's'}: " + ", ".join(words)


def draft_phrase(s: dict) -> str:
    """The draft's part, e.g. "draft small: 30 of 48 proposed tokens accepted (62%)"."""
    if s.get("draft_fallback"):
        return f"draft {s['draft']} not used (it could not roll back exactly here: see the notice)"
    proposed, accepted = s.get("draft_tokens_proposed", 0), s.get("draft_tokens_accepted", 0)
    rate = f" ({s['draft_acceptance']:.0%})" if s.get("draft_acceptance") is not None else ""
    return f"draft {s['draft']}: {accepted} of {proposed} proposed tokens accepted{rate}"


def lookup_phrase(s: dict) -> str | None:
    """Drafts from the context, where they ran and proposed, e.g. "lookup: 40 of 48 drafted tokens accepted
    (83%), 2.10x"; or why they could not run when asked for."""
    if s.get("lookup_drafts_fallback"):
        return f"lookup not used ({s['lookup_drafts_fallback'].split(':')[0]})"
    if not s.get("lookup_drafts_proposed"):
        return None
    rate = f" ({s['lookup_drafts_acceptance']:.0%})" if s.get("lookup_drafts_acceptance") is not None else ""
    speed = f", {s['lookup_drafts_speedup']:.2f}x" if s.get("lookup_drafts_speedup") else ""
    return f"lookup: {s['lookup_drafts_accepted']} of {s['lookup_drafts_proposed']} drafted tokens accepted{rate}{speed}"


def passages_phrase(s: dict) -> str:
    """Passages placed from their KV, e.g. "passages reused: 7 of 8, 13% recomputed (approximate)"."""
    label = "approximate" if s.get("approximate") else "exact"
    return (f"passages reused: {s.get('passages_reused', 0)} of {s['passages']}, "
            f"{s.get('passage_recomputed_share', 0.0):.0%} recomputed ({label})")


class CellResult:
    """What ``%%generate`` returns (and stores in ``--out``).

    ``.text``, ``.tokens`` (generated ids), ``.stats`` (dict), ``.parsed`` (with --json, --regex,
    --choice or --grammar: the answer parsed, None when incomplete), ``.reasoning``, ``.steps`` (with
    --tools), ``.prompt`` (the interpolated cell), ``.model``, ``.session``. Displays as the cell footer;
    ``str()`` is the text.
    """

    def __init__(self, result, *, prompt: str, model: str | None, session: str | None, use_cache: bool,
                 tokenizer=None):
        self.result = result
        self.text = result.text
        self.tokens = list(result.tokens)
        self.stats = dict(result.stats)
        self.logprobs = result.logprobs  # TokenLogprob per token with --logprobs, else None
        self.parsed = getattr(result, "parsed", None)
        self.reasoning = getattr(result, "reasoning", "")  # a thinking model's reasoning, apart from .text
        self.steps = list(getattr(result, "steps", []))  # with --tools: each tool step (.call, .arguments, .result)
        self._pieces = logprob_pieces(tokenizer, self.logprobs) if self.logprobs and tokenizer else []
        self.prompt = prompt
        self.model = model
        self.session = session
        self.use_cache = use_cache

    def __str__(self) -> str:
        return self.text

    def footer(self) -> str:
        s = self.stats
        n = s.get("prompt_tokens", 0)
        prompt = (
            f"{n} prompt tokens: {s.get('ram_tokens', 0)} from RAM, {s.get('ssd_tokens', 0)} from SSD, "
            + (f"{s['remote_tokens']} from remote, " if s.get("remote_tokens") else "")
            + (f"{s['passage_tokens_placed']} from passages, " if s.get("passage_tokens_placed") else "")
            + f"{s.get('prefilled_tokens', n)} prefilled" + ("" if self.use_cache else " (cache off)")
        )
        tps = s.get("decode_tokens_per_s")
        decoded = s.get("decode_tokens", len(self.tokens))
        parts = [
            prompt,
            f"TTFT {fmt_s(s.get('ttft_s'))}",
            f"{decoded} tokens at {tps:.1f} tok/s" if tps else f"{decoded} tokens",
            STOPS.get(s.get("finish_reason"), f"finish: {s.get('finish_reason', '?')}"),
        ] + [p for p in (constraint_phrase(s),) if p]  # right after why it ended: "incomplete JSON (max tokens)"
        parts += [p for p in (context_phrase(n, decoded, s.get("context_window")), speed_phrase(s)) if p]
        if s.get("draft"):
            parts.insert(-1, draft_phrase(s))
        if lookup_phrase(s):
            parts.insert(-1, lookup_phrase(s))
        if s.get("audio_sources"):
            parts.insert(1, images_phrase(s["audio_sources"], "recording"))
        if s.get("video_sources"):
            parts.insert(1, images_phrase(s["video_sources"], "video"))
        if s.get("image_sources"):
            parts.insert(1, images_phrase(s["image_sources"]))
        if steps_phrase(self.steps):
            parts.insert(1, steps_phrase(self.steps))
        if s.get("cache_note"):  # (a checkpoint too large to keep in RAM; memory short)
            parts.insert(1, s["cache_note"])
        if s.get("prefill_note"):  # (the chat template rewrote what the history held)
            parts.insert(1, s["prefill_note"])
        if s.get("truncated_tokens"):  # (--truncate: the prompt was past the model's window)
            parts.insert(1, f"{s['truncated_tokens']} prompt tokens dropped to fit the model's window")
        if s.get("passages"):
            parts.insert(1, passages_phrase(s))
        resumed = s.get("resumed_from")
        if resumed:
            parts.insert(1, f"resumed from an in-flight checkpoint at token {resumed}")
        tail = f"model {self.model}" + (f", session {self.session}" if self.session else "")
        why = f"\n[mlxcache] why: {s['cache_why']} (%cache why)" if s.get("cache_why") else ""
        return "[mlxcache] " + " · ".join(parts) + f" · {tail}" + why

    def __repr__(self) -> str:
        return self.footer()

    def _repr_pretty_(self, p, cycle) -> None:
        constrained = bool(self.stats.get("constraint"))
        p.text(logprob_text(self._pieces, constrained) + self.footer() if self._pieces else self.footer())

    def _repr_html_(self) -> str:
        return (logprob_html(self._pieces) if self._pieces else "") + footer_html(self.stats, self.footer())


def logprob_pieces(tokenizer, logprobs: list) -> list[dict]:
    """Per token: its text, log-probability, probability and its alternatives' texts (for display)."""
    def text(t: int) -> str:
        return tokenizer.decode([t])

    return [{"text": text(lp.token), "logprob": lp.logprob, "p": math.exp(lp.logprob),
             "top": [(text(t), math.exp(v)) for t, v in lp.top]} for lp in logprobs]


def logprob_text(pieces: list[dict], constrained: bool = False) -> str:
    """A table: each token, its log-probability and probability, and its most likely alternatives (under a
    constraint: of the constrained distribution, the alternatives the grammar allowed)."""
    lines = ["token                 logprob      p   alternatives" + ("   (constrained)" if constrained else "")]
    for r in pieces:
        alts = ", ".join(f"{t!r} {p:.0%}" for t, p in r["top"][:5])
        lines.append(f"{r['text']!r:20.20}  {r['logprob']:8.3f}  {r['p']:5.0%}   {alts}")
    return "\n".join(lines) + "\n"


def logprob_html(pieces: list[dict]) -> str:
    """The text as a band of tokens, each shaded by how sure the model was (red: unsure), its
    log-probability and alternatives on hover."""
    spans = []
    for r in pieces:
        alts = " · ".join(f"{t!r} {p:.1%}" for t, p in r["top"])
        tip = f"logprob {r['logprob']:.3f} ({r['p']:.1%})" + (f" | {alts}" if alts else "")
        shade = f"rgba(229,57,53,{0.55 * (1 - r['p']):.2f})"
        spans.append(f"<span class='mlxc-token' title='{html.escape(tip, quote=True)}' data-logprob='{r['logprob']:.4f}'"
                     f" style='background:{shade};white-space:pre-wrap'>{html.escape(r['text'])}</span>")
    return f"<div class='mlxc-logprobs' style='font-family:monospace;line-height:1.6'>{''.join(spans)}</div>"
