"""Which proposer a generation's row gets: a draft model, drafts from its own context, both (the one
whose proposals are kept more often proposes), or none where rejected tokens cannot be rolled back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ...errors import GenerationError
from .draft import Drafter, fallback_reason, rollback_reason
from .lookup import ContextLookup


class BestOf:
    """Several proposers; each round the one whose proposals were kept most often (smoothed, so an
    untried one gets its turn) proposes, and the others stay in step."""

    def __init__(self, proposers: list):
        self.proposers, self.last = proposers, None

    @staticmethod
    def _rate(p) -> float:
        proposed, accepted = _counts(p)
        return (accepted + 1) / (proposed + 2)

    def wants(self, step: int) -> bool:
        return any([p.wants(step) for p in self.proposers])  # (each asked: a draft notes its first step)

    def propose(self, context: Sequence[int], limit: int, params, step: int, constraint=None) -> list:
        for p in sorted(self.proposers, key=self._rate, reverse=True):
            if p.wants(step):
                drafts = p.propose(context, limit, params, step, constraint)
                if drafts:
                    self.last = p
                    return drafts
        return []

    def judged(self, proposed: int, accepted: int) -> None:
        self.last.judged(proposed, accepted)

    def stepped(self, step: int, tokens: int, seconds: float, proposed: int, pipelined: bool = False) -> None:
        for p in self.proposers:
            p.stepped(step, tokens, seconds, proposed if p is self.last else 0, pipelined)


def _counts(p) -> tuple:
    return (p.counts.proposed, p.counts.accepted) if isinstance(p, Drafter) else (p.proposed, p.accepted)


@dataclass
class Choice:
    proposer: object = None  # what the loop's row gets
    drafter: Drafter | None = None
    lookup: ContextLookup | None = None
    draft_fallback: str | None = None  # why the draft model was not used
    lookup_fallback: str | None = None  # why drafts from the context were not used (when asked for)

    def lookup_stats(self, asked: bool | None) -> dict:
        """What drafts from the context did: `lookup` (True: on, forced or where it paid; False: off),
        its counts and measured speed-up, or why it could not run."""
        out = {"lookup_drafts": self.lookup is not None,
               "lookup_drafts_fallback": self.lookup_fallback if asked else None}
        if self.lookup is not None:
            out.update(self.lookup.stats())
        return out


def check_lookup(lookup):
    """`lookup` as given (None, True or False), else a GenerationError naming it."""
    if lookup is not None and not isinstance(lookup, bool):
        raise GenerationError(f"lookup must be True, False or None (where it pays), got {lookup!r}")
    return lookup


def choose_proposers(services, req, caches: list, known: int) -> Choice:
    """The proposers for a generation (a `Request` of generation.py) whose caches hold `known` tokens.
    lookup: None proposes from the context where it may pay (text models that can roll back), True
    where it can, False never."""
    c = Choice()
    if req.draft is not None:
        c.draft_fallback = fallback_reason(req.model, caches, req.draft, known, req.params.max_tokens)
        if c.draft_fallback:
            services.events.emit("notice", model=req.model.name, message=c.draft_fallback)
        else:
            c.drafter = Drafter(services, req.draft, req.use_cache, len(req.tokens), req.ns, req.num_draft_tokens)
    if req.lookup is not False:
        if req.model.vision is not None:
            c.lookup_fallback = "drafts from the context apply to text models: decoding without them (same tokens)"
        else:
            c.lookup_fallback = rollback_reason(req.model, caches, known, req.params.max_tokens,
                                                "drafts from the context")
        if c.lookup_fallback is None:
            c.lookup = ContextLookup(forced=bool(req.lookup))
        elif req.lookup:
            services.events.emit("notice", model=req.model.name, message=c.lookup_fallback)
    found = [p for p in (c.drafter, c.lookup) if p is not None]
    c.proposer = found[0] if len(found) == 1 else BestOf(found) if found else None
    return c
