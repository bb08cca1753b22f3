"""Why a prompt reused less of the cache than it could: the nearest cached prefix, the first token where
it and the prompt part (the text on both sides), and what differed (`%cache why`, the footer's line).

No anchor tells its users why a request missed (mlx-lm #1803 and #137; oMLX #2255, where JSON key order
made every request a miss). The causes, by what they would have reused:

- another chat template, system prompt or a date in the template: the prompt's text is cached after
  another start (a run of the prompt's tokens found further on in a cached prefix);
- another model, adapter or KV setting: a longer prefix is cached under another namespace, whose
  identity (weights, config, tokenizer, KV scheme, adapter, runtime) says what differs;
- evicted or not written: a longer prefix left RAM (the budget, memory pressure, a clear) without a
  copy on SSD, or its SSD file was removed (`Departures` remembers the last few);
- a state that cannot be cut back: a longer entry shares more, but its cache (a sliding window that
  wrapped, recurrent state, KV quantized from a later token) serves only its own length;
- none of these: the prompt follows the nearest prefix and then says something new (no footer line).

Reads token ids and the catalogue's index only (no MLX), on the owner thread, when a lookup reused
less than all but the prompt's last token.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..kv.tokens import as_token_array, common_prefix_len, token_key

SLACK = 16  # a cause names itself when it would have reused this many tokens more than were
PROBE = 32  # tokens of the prompt looked for further on in cached prefixes (the same text after another start)
WINDOW = 16  # tokens of text shown on each side of where the prompt and the nearest prefix part
MAX_GONE = 64  # departed prefixes remembered
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}\s+(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?,?\s+\d{4}"
                   r"|(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?\s+\d{1,2},?\s+\d{4}|today date", re.I)
_IDENTITY_WORDS = {"artifact": "weights", "config": "config", "tokenizer": "tokenizer", "adapter": "adapter",
                   "runtime": "mlx / mlx-lm version"}
SURPRISING = ("template", "system_prompt", "date", "other_model", "evicted", "not_written", "uncuttable")


@dataclass(frozen=True)
class Cached:
    """A cached prefix to compare a prompt with."""

    ns: str
    tokens: np.ndarray
    where: str  # "RAM", "SSD", or how it left ("evicted from RAM by the budget ...")
    can_serve: Callable[[int], bool] = lambda n: True
    identity: dict | None = None
    gone: str | None = None  # the cause code of a departed prefix: "evicted" or "not_written"
    exact_only: str = ""  # why it cannot be cut back, in words ("" where it can)


@dataclass
class Why:
    cause: str  # one of SURPRISING, or "diverged", "new", "hit", "uncached"
    line: str  # one line: the footer's (where `surprising`) and the first of `%cache why`
    details: list = field(default_factory=list)  # the nearest prefix, where it parts, what differed
    prompt_tokens: int = 0
    reused: int = 0
    could: int = 0  # tokens the cause would have served

    @property
    def surprising(self) -> bool:
        return self.cause in SURPRISING

    def __str__(self) -> str:
        return "\n".join([self.line, *("  " + d for d in self.details)])


class Departures:
    """Prefixes that left the cache without a copy elsewhere, the last MAX_GONE (any thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._gone: OrderedDict = OrderedDict()  # (ns, token key) -> Cached

    def left(self, ns: str, tokens, where: str, cause: str = "evicted") -> None:
        arr = as_token_array(tokens)
        with self._lock:
            key = (ns, token_key(tokens))
            self._gone.pop(key, None)
            self._gone[key] = Cached(ns, arr, f"{where} ({time.strftime('%H:%M:%S')})", gone=cause)
            while len(self._gone) > MAX_GONE:
                self._gone.popitem(last=False)

    def returned(self, ns: str, tokens) -> None:
        """Cached again (written or published anew): not gone any more."""
        with self._lock:
            self._gone.pop((ns, token_key(tokens)), None)

    def all(self) -> list[Cached]:
        with self._lock:
            return list(self._gone.values())


class Explainer:
    """Explains lookups against what the cache holds now and what left it (`explain`)."""

    def __init__(self, candidates: Callable[[], list], departures: Departures, identities: Callable[[str], dict | None],
                 decode: Callable[[str, list], str | None], model_name: Callable[[str], str | None]):
        """candidates(): every cached prefix now (Cached); decode(ns, tokens): text, None without the
        namespace's tokenizer; model_name(ns): a loaded model's name."""
        self.candidates, self.departures, self.identities = candidates, departures, identities
        self.decode, self.model_name = decode, model_name
        self.last: Why | None = None

    def explain(self, prompt, ns: str, reused: int | None = None) -> Why:
        """Why a lookup of `prompt` reused `reused` tokens (None: what a lookup would reuse now)."""
        prompt = as_token_array(prompt)
        n = len(prompt)
        if reused is None:
            mine = [(min(common_prefix_len(c.tokens, prompt), n - 1), c) for c in self.candidates() if c.ns == ns]
            reused = max([k for k, c in mine if k > 0 and c.can_serve(k)], default=0)
        if reused >= n - 1:
            why = Why("hit", f"all {n - 1} prompt tokens but the last came from the cache", prompt_tokens=n,
                      reused=reused, could=reused)
        else:
            why = self._explain(prompt, ns, reused)
        self.last = why
        return why

    def _explain(self, prompt: np.ndarray, ns: str, reused: int) -> Why:
        n, cap = len(prompt), len(prompt) - 1
        now = self.candidates()
        shared = [(min(common_prefix_len(c.tokens, prompt), cap), c) for c in now]
        mine = [(k, c) for k, c in shared if c.ns == ns and k > 0]
        best_mine, nearest = max(mine, key=lambda kc: (kc[0], kc[1].can_serve(kc[0])), default=(0, None))
        options = []  # (tokens it would have served, Why)
        for k, c in mine:
            if k > reused + SLACK and not c.can_serve(k):
                options.append((k, self._uncuttable(prompt, c, k)))
        others = [(k, c) for k, c in shared if c.ns != ns and k > max(best_mine, reused) + SLACK]
        if others:
            k, c = max(others, key=lambda kc: kc[0])
            options.append((k, self._other_model(prompt, ns, c, k)))
        gone = [(min(common_prefix_len(c.tokens, prompt), cap), c) for c in self.departures.all() if c.ns == ns]
        gone = [(k, c) for k, c in gone if k > max(best_mine, reused) + SLACK]
        if gone:
            k, c = max(gone, key=lambda kc: kc[0])
            options.append((k, self._gone(prompt, c, k)))
        shifted = self._shifted(prompt, [c for c in now if c.ns == ns], reused)
        if shifted is not None:
            options.append(shifted)
        if options:
            could, why = max(options, key=lambda o: o[0])
        elif nearest is not None or reused:  # (an entry lent in place to this generation is out of sight)
            could = max(best_mine, reused)
            where = nearest.where if nearest is not None else "lent to this generation"
            why = Why("diverged", f"the prompt follows a cached prefix ({where}) for {could} tokens, then says something new")
            if nearest is not None:
                why.details = self._parting(prompt, nearest, best_mine)
        else:
            could, why = 0, Why("new", "nothing cached starts like this prompt")
        why.prompt_tokens, why.reused, why.could = n, reused, could
        why.details.append(f"reused {reused} of {n} prompt tokens" + (f"; {could} were cached" if could > reused else ""))
        return why

    # --- the causes ---

    def _uncuttable(self, prompt, c: Cached, k: int) -> Why:
        why = Why("uncuttable", f"a cached state shares {k} tokens but cannot be cut back to them: {c.exact_only}")
        why.details = [f"nearest: {len(c.tokens)} tokens in {c.where}", *self._parting(prompt, c, k)]
        return why

    def _other_model(self, prompt, ns: str, c: Cached, k: int) -> Why:
        ours, theirs = self.identities(ns) or {}, c.identity or self.identities(c.ns) or {}
        differs = [_differs(key, ours.get(key), theirs.get(key)) for key in sorted(set(ours) | set(theirs))
                   if ours.get(key) != theirs.get(key)]
        name = self.model_name(c.ns)
        whose = f"model {name}" if name else "a model not loaded now"
        why = Why("other_model", f"{k} tokens of this prompt are cached for {whose}: "
                                 f"{', '.join(differs) or 'another namespace'}")
        why.details = [f"nearest: {len(c.tokens)} tokens in {c.where}, namespace {c.ns}"]
        return why

    def _gone(self, prompt, c: Cached, k: int) -> Why:
        words = "was cached and left" if c.gone == "evicted" else "was cached but never written to SSD; it left"
        why = Why(c.gone or "evicted", f"a prefix of {k} tokens {words}: {c.where}")
        why.details = self._parting(prompt, c, k)
        return why

    def _shifted(self, prompt: np.ndarray, mine: list, reused: int) -> tuple | None:
        """The prompt's text cached after another start: (tokens it would have served, Why) or None."""
        n = len(prompt)
        if n < 4 * PROBE or reused > n // 2:
            return None
        raw = prompt.astype("<i4").tobytes()
        best = None  # (run end, i0, j0, start shared, cached)
        for at in sorted({n // 4, n // 2, (3 * n) // 4}):
            if at < reused or at + PROBE >= n:
                continue
            probe = raw[4 * at : 4 * (at + PROBE)]
            for c in mine:
                start = common_prefix_len(c.tokens, prompt)
                for j in _find_aligned(c.tokens.astype("<i4").tobytes(), probe):
                    back = common_prefix_len(prompt[:at][::-1], c.tokens[:j][::-1])
                    i0, j0 = at - back, j - back
                    end = min(at + common_prefix_len(prompt[at:], c.tokens[j:]), n - 1)
                    after_start = i0 > start or (i0 != j0 and i0 == start)  # not the common start itself
                    if after_start and end - i0 >= 2 * PROBE and (best is None or end - i0 > best[0] - best[1]):
                        best = (end, i0, j0, start, c)
        if best is None:
            return None
        end, i0, j0, start, c = best
        if end <= reused + SLACK:
            return None
        head = self.decode(c.ns, prompt[:start].tolist()) or ""
        gaps = [self.decode(c.ns, t[start:i].tolist()) or "" for t, i in ((prompt, i0), (c.tokens, j0))]
        near = [self.decode(c.ns, t[max(0, start - WINDOW) : i + WINDOW].tolist()) or ""  # a date's digits
                for t, i in ((prompt, i0), (c.tokens, j0))]                                 # need their context
        if any(_DATE.search(x) for x in near):
            cause, what = "date", "a date in the template differs"
        elif _last_role(head) == "system" or (all(g.strip() for g in gaps) and "system" in "".join(gaps).lower()):
            cause, what = "system_prompt", "another system prompt"
        else:
            cause, what = "template", "another chat template or start of the prompt (or none: --raw)"
        why = Why(cause, f"{what}: {end - i0} tokens of this prompt are cached ({c.where}) after another "
                         f"start; a cache serves only a common start")
        why.details = [f"nearest: {len(c.tokens)} tokens in {c.where}; the same text from its token {j0} "
                       f"(the prompt's {i0})", *self._parting(prompt, c, start)]
        return end, why

    def _parting(self, prompt: np.ndarray, c: Cached, k: int) -> list[str]:
        """Where the prompt and a cached prefix part (token k), with the text on both sides."""
        before = self.decode(c.ns, prompt[max(0, k - WINDOW) : k].tolist())
        if before is None:
            return [f"they part at token {k}"]
        here = self.decode(c.ns, prompt[k : k + WINDOW].tolist())
        there = self.decode(c.ns, c.tokens[k : k + WINDOW].tolist()) if k < len(c.tokens) else ""
        return [f"they part at token {k}, after {_quote(before, tail=True)}",
                f"  this prompt: {_quote(here)}", f"  cached:      {_quote(there) if there else '(its end)'}"]


def cached_prefixes(ram_entries, ssd_entries, identities: dict) -> list[Cached]:
    """RAM entries (ram.py's `Entry`) and SSD files (ssd/index.py's `IndexEntry`) as prefixes to compare."""
    out, seen = [], set()
    for e in ram_entries:
        if e.tokens:  # (an object holds no tokens)
            seen.add((e.ns, e.tokens))
            cp = e.checkpoint
            out.append(Cached(e.ns, e.token_array, "RAM", cp.can_serve, identities.get(e.ns),
                              exact_only=exact_words(len(e.tokens), cp.trimmable, cp.min_reusable_offset)))
    for h in ssd_entries:
        if h.tokens and (h.namespace, tuple(h.tokens)) not in seen:
            out.append(Cached(h.namespace, as_token_array(h.tokens), "SSD", h.can_serve, h.identity,
                              exact_only=exact_words(len(h), h.trimmable, h.min_reusable_offset)))
    return out


def left_ram(entry, reason: str, ssd: bool) -> tuple[str, str]:
    """(where it went, cause) of a RAM entry that left with no SSD copy."""
    if reason in ("cleared", "removed"):
        return f"removed from RAM ({reason})", "evicted"
    why = {"budget": "by the RAM budget", "oversized": "larger than the whole RAM budget",
           "pressure": "under memory pressure"}.get(reason, reason)
    where = ("with no SSD tier" if not ssd else f"before its SSD write succeeded ({entry.write_error})"
             if entry.write_error else "before its SSD write committed")
    return f"evicted from RAM {why} {where}", "not_written"


def exact_words(n: int, trimmable: bool, min_reusable_offset: int) -> str:
    """Why a state of n tokens serves no shorter prefix, in words ("" where it serves any from 1 on)."""
    if not trimmable:
        return f"its state (a sliding window that wrapped, or recurrent layers) serves only its own {n} tokens"
    if min_reusable_offset:
        return f"its KV is quantized from token {min_reusable_offset} on: it serves prefixes that long or longer"
    return ""


def _find_aligned(haystack: bytes, needle: bytes, most: int = 8) -> list[int]:
    """Token indices of the first `most` occurrences of `needle` (int32 tokens) in `haystack`."""
    found, i = [], haystack.find(needle)
    while i >= 0 and len(found) < most:
        if i % 4 == 0:
            found.append(i // 4)
        i = haystack.find(needle, i + 1)
    return found


def _last_role(text: str) -> str | None:
    found = {role: text.lower().rfind(role) for role in ("system", "user", "assistant")}
    role, at = max(found.items(), key=lambda kv: kv[1])
    return role if at >= 0 else None


def _differs(key: str, ours, theirs) -> str:
    if key == "kv_scheme":
        return f"{kv_words(theirs)} there, {kv_words(ours)} here"
    if key == "adapter":
        return "another adapter" if ours and theirs else "an adapter " + ("here" if ours else "there")
    return f"another {_IDENTITY_WORDS.get(key, key)}"


def kv_words(scheme: str | None) -> str:
    """A KV scheme in words: "8-bit KV (groups of 64) from token 5000", "full-precision KV"."""
    m = re.search(r":q(\d+)g(\d+)(?:@(\d+))?$", scheme or "")
    if not m:
        return "full-precision KV"
    return f"{m[1]}-bit KV (groups of {m[2]})" + (f" from token {m[3]}" if m[3] else "")


def _quote(text: str, tail: bool = False) -> str:
    text = text.replace("\n", "\\n")
    if len(text) > 60:
        text = ("…" + text[-59:]) if tail else (text[:59] + "…")
    return f'"{text}"'
