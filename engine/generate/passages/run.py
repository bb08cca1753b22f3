"""A prompt's passages placed from their cached KV: `Engine.generate(prompt, passages=[...])`.

The order of work, before the generation proper (generation.py) takes the state over:

1. The prompt's tokens and each passage's span (prompt.py); passages that fit the window,
   a model whose keys can move (moves.py), options that go with an approximate state.
2. The exact prefix cache, as for any prompt: the longest cached prefix (RAM, SSD, team tier).
   Whatever it leaves of the template's head (a system prompt) is prefilled and published as an
   exact prefix, so the next question finds it.
3. Each passage's KV from the tiers, or encoded once and stored there (store.py).
4. Placed, chosen tokens recomputed (blend.py). A first passage right after exactly the lead-in
   sits where it was computed, after what it was computed after: it is exact there.
5. The generation prefills the rest of the prompt (the question) over that state and decodes.
   Its state is not what a full prefill computes, so nothing of it is published: the prompt's
   checkpoints, in-flight records and interrupted states are all skipped (use_cache is off for
   the generation; only the exact head of step 2 and the passage objects are stored).

The stats say what was done (`figures`), and `approximate` whether any placed token was not
recomputed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...errors import PassageError
from ...kv.caches import holding, kv_arrays
from ...kv.checkpoint import Checkpoint
from ...metrics import cached_stats
from ..prefill import prefill
from ..window import fit
from .blend import choose, deviations, needs_deviations, place, recompute
from .moves import mover_for
from .prompt import as_passages, check_window, passage_prompt
from .store import passage_states


@dataclass
class Placed:
    """The state a generation starts from, as a loan is (caches holding `length` tokens, `source`,
    `release`), with when the work began (the generation's time to first token counts from there)
    and what it did."""

    caches: list
    length: int
    source: str | None
    t0: float
    cached: int = 0  # the exact prefix the cache lent
    head: int = 0  # tokens of the template's head prefilled here
    head_s: float = 0.0
    figures: dict = field(default_factory=dict)
    _release: object = None

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def stats(self, stats: dict) -> dict:
        """What the generation's stats become: the cached prefix as lent, the head counted as prefilled."""
        out = {**cached_stats(self.cached, self.source if self.cached else None), **self.figures}
        out["prefilled_tokens"] = stats["prefilled_tokens"] + self.head
        out["prefill_s"] = stats["prefill_s"] + self.head_s
        out["passages_s"] = self.figures["passages_s"]
        return out


def with_passages(eng, m, params, prompt: str, passages, recompute: float | None, *, system=None, raw=False,
                  media=None, run: dict):
    """`Engine.generate(prompt, passages=...)`: the passages placed, then the generation from that state
    (run: the generation's options, as Engine.generate gathers them)."""
    check_options(session=run.get("session"), checkpoint_every=run.get("checkpoint_every"), media=bool(media),
                  truncate=run.get("truncate"))
    fraction = eng.config.passage_recompute if recompute is None else recompute
    tokens, placed = place_passages(eng._services, eng.objects, m, prompt, passages, fraction=fraction,
                                    system=system, raw=raw, use_cache=run.get("use_cache", True),
                                    room=params.max_tokens)
    try:
        return eng._generate(m, tokens, params, dict(run, use_cache=False, prepared=placed))
    finally:
        placed.release()


def check_options(*, session=None, checkpoint_every=None, media=False, truncate=None) -> None:
    if session is not None:
        raise PassageError("passages do not go with a session (a chat keeps exact turns): leave session out, "
                           "or put the passages in the turn's text")
    if checkpoint_every is not None:
        raise PassageError("passages do not go with checkpoint_every (an in-flight checkpoint is an exact state)")
    if media:
        raise PassageError("passages do not go with images, videos or audio")
    if truncate is not None:
        raise PassageError("passages are never cut to fit the window: leave truncate out, or pass fewer passages")


def check_fraction(recompute) -> float:
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0 <= recompute <= 1:
        raise PassageError(f"recompute is the fraction of placed passage tokens to recompute, from 0 to 1; "
                           f"got {recompute!r}")
    return float(recompute)


def place_passages(services, objects, m, prompt: str, passages, *, fraction: float, system: str | None = None,
                   raw: bool = False, use_cache: bool = True, room: int = 0) -> tuple[list, Placed]:
    """(the prompt's token ids, the state to generate from). objects: the engine's ObjectCache; fraction:
    of the placed tokens, to recompute; room: the tokens to generate (the prompt and they fit the window)."""
    t0 = time.perf_counter()
    fraction = check_fraction(fraction)
    mover = mover_for(m)
    pp = passage_prompt(m.tokenizer, prompt, as_passages(passages), system=system, raw=raw)
    check_window(m, pp)
    fit(m, pp.tokens, room, None)  # the whole prompt too, before any work (GenerationError naming both numbers)
    cache, ns, chunk = services.cache, m.namespace, services.prefill_chunk
    first, end = pp.spans[0][0], pp.spans[-1][1]
    with cache.generating():
        loan = cache.take(pp.tokens, ns) if use_cache else None
        cached, source = (loan.length, loan.source) if loan else (0, None)
        if cached >= end:  # a prompt the cache holds exactly through its passages: nothing to place
            figures = _figures(pp, cached, [], 0, fraction, None, t0, [])
            return pp.tokens, Placed(loan.caches, cached, source, t0, cached, figures=figures, _release=loan.release)
        prefix = [kv_arrays(c) for c in loan.caches] if loan else [(None, None)] * len(m.new_caches())
        if loan:
            loan.release()
        head_s = 0.0
        if cached < first:  # the template's head: prefilled exactly, published for the next question
            t1 = time.perf_counter()
            fresh = m.new_caches()
            caches = [holding(c, k, v) for c, (k, v) in zip(fresh, prefix)] if cached else fresh
            prefill(m.model, caches, pp.tokens[cached:first], chunk=chunk)
            if use_cache:
                cache.put(Checkpoint.capture(pp.tokens[:first], caches, copy=True), ns)
                cache.queue_dirty()
            prefix = [kv_arrays(c) for c in caches]
            head_s = time.perf_counter() - t1
        states, encoded = passage_states(m, objects if use_cache else None, pp.lead_in,
                                         [pp.tokens[s:e] for s, e in pp.spans], chunk=chunk)
        if encoded.tokens:
            services.metrics.record_prefill(ns, encoded.tokens, encoded.seconds)
        layout = place(mover, prefix, max(cached, first), pp.spans, states, len(pp.lead_in))
        if layout.spans and pp.tokens[:first] == pp.lead_in and layout.spans[0][1] == pp.spans[0][1]:
            layout.exact = layout.spans.pop(0)[1]  # after exactly the lead-in, where it was computed: exact
        moved = deviations(m.model, mover, layout, pp.tokens) if needs_deviations(layout, fraction) else None
        chosen = choose(layout, fraction, moved)
        recompute(m.model, mover, layout, pp.tokens, chosen)
        caches = [holding(c, k, v) for c, k, v in zip(m.new_caches(), layout.keys, layout.values)]
    figures = _figures(pp, cached, states, layout.placed, fraction, encoded, t0, chosen, layout.exact)
    return pp.tokens, Placed(caches, end, source, t0, cached, max(0, first - cached), head_s, figures)


def _figures(pp, cached: int, states: list, placed: int, fraction: float, encoded, t0: float, chosen: list,
             exact: int | None = None) -> dict:
    """The passages' part of the stats (see docs/engine-api.md)."""
    exact = cached if exact is None else exact
    first, end = pp.spans[0][0], pp.spans[-1][1]
    return {
        "passages": len(pp.spans),
        "passages_reused": sum(1 for s in states if s.source != "encoded") if states else len(pp.spans),
        "passage_sources": [s.source for s in states] or ["prefix"] * len(pp.spans),
        "passage_tokens": end - first,
        "passage_tokens_exact": max(0, min(exact, end) - first),
        "passage_tokens_placed": end - max(cached, first),
        "passage_tokens_recomputed": len(chosen),
        "passage_recompute": fraction,
        "passage_recomputed_share": len(chosen) / placed if placed else 0.0,
        "passages_encoded": encoded.passages if encoded else 0,
        "passage_tokens_encoded": encoded.tokens if encoded else 0,
        "passage_encode_s": encoded.seconds if encoded else 0.0,
        "passages_s": time.perf_counter() - t0,
        "approximate": placed > len(chosen),
    }
