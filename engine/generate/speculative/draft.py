"""Speculative decoding: a draft model proposes tokens, the target verifies them in one forward.

Exact by construction: the token at step i is the target's sample at step i, drawn by the
(seed, step) sampler of sampling.py from the target's logits after the tokens actually emitted.
A draft token is accepted iff it equals that sample, so the draft only decides how many target
samples one forward yields, never which (greedy and seeded output equal plain decoding's).

Rejected tokens are cut back from both models' caches (generate/rewind.py): plain and quantized KV
trimmed; a sliding window that may wrap, recurrent state, chunked attention or a list of them
restored from before the forward and the accepted tokens forwarded again. What cannot roll back
exactly (an unknown cache kind, a delayed KV quantization converting during the generation):
`fallback_reason` names it and the generation decodes plainly, after a one-line notice.

The draft's KV lives in the same tiered cache under the draft model's own namespace: taken at
its first proposal (the longest cached prefix, any tier), published at the end. The first round
proposes nothing, so the first token comes as fast as without a draft (the draft's lookup and
prefill come after it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from ..prefill import prefill
from ...kv.caches import unsupported
from ...kv.checkpoint import Checkpoint
from ...models.registry import LoadedModel, ModelError
from ..sampling import GenerationError, SamplingParams, sample
from ..rewind import Rewind, cuttable

DEFAULT_DRAFT_TOKENS = 4
MAX_DRAFT_TOKENS = 32


def load_with_draft(models, draft: str | None, path_or_id, name: str, **kv) -> LoadedModel:
    """models.load(...), with `draft` (a loaded model's name) as the new model's default draft."""
    if draft is not None and (not isinstance(draft, str) or draft not in models):
        raise ModelError(f"unknown draft model {draft!r}: load it before the model it drafts for; "
                         f"loaded: {', '.join(sorted(models.names())) or 'none'}")
    if draft is not None and draft == name:
        raise ModelError(f"model {name!r} cannot be its own default draft: it replaces the loaded {draft!r}")

    def drafted_by(loaded: LoadedModel) -> None:  # before it replaces a model of that name
        try:
            check_draft(loaded, models.get(draft))
        except GenerationError as e:
            raise ModelError(f"model {name!r} not loaded: {e}") from None

    loaded = models.load(path_or_id, name, check=drafted_by if draft is not None else None, **kv)
    if draft is not None:
        loaded.info["draft"] = draft
    return loaded


def resolve_draft(models, target: LoadedModel, draft: str | bool | None, num_draft_tokens) -> tuple:
    """(the draft LoadedModel or None, K) for a generation; a clear error for bad input.
    draft=None: the model's default draft (load_model(..., draft=NAME)), if any; False: none."""
    if draft is None and target.info.get("draft") is not None:
        draft = target.info["draft"]
        if draft not in models:
            raise ModelError(f"model {target.name!r}'s default draft {draft!r} is not loaded: load it again, "
                             "or pass draft=False (%%generate --no-draft)")
    if draft is None or draft is False:
        if num_draft_tokens is not None:
            raise GenerationError("num_draft_tokens needs a draft model (draft=NAME)")
        return None, 0
    k = DEFAULT_DRAFT_TOKENS if num_draft_tokens is None else num_draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise GenerationError(f"num_draft_tokens must be an integer from 1 to {MAX_DRAFT_TOKENS}, got {k!r}")
    if not isinstance(draft, str) or draft not in models:
        raise ModelError(f"unknown draft model {draft!r}: load it first (load_model(path, name=...)); "
                         f"loaded: {', '.join(sorted(models.names())) or 'none'}")
    d = models.get(draft)
    check_draft(target, d)
    return d, k


def check_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft must be a text model sharing the target's tokenizer and vocabulary."""
    if draft.vision is not None:
        raise GenerationError(f"draft model {draft.name!r} is a vision-language model; a draft must be a text model")
    if target.vision is not None:
        raise GenerationError(f"model {target.name!r} is a vision-language model: speculative decoding with a "
                              "draft applies to text models")
    if draft.identity.get("tokenizer") != target.identity.get("tokenizer"):
        raise GenerationError(f"draft model {draft.name!r} has another tokenizer than {target.name!r} "
                              "(their tokenizer files differ): a draft must share the target's tokenizer")
    dv, tv = draft.config.get("vocab_size"), target.config.get("vocab_size")
    if dv != tv:
        raise GenerationError(f"draft model {draft.name!r} has a vocabulary of {dv} tokens, {target.name!r} "
                              f"of {tv}: a draft must share the target's vocabulary")


def _converts(m: LoadedModel, start: int, end: int) -> bool:
    """Whether a delayed KV quantization converts this model's caches between lengths start and end."""
    return bool(m.kv_bits is not None and m.kv_start and start < m.kv_start <= end)


def rollback_reason(m: LoadedModel, caches: list, known: int, max_tokens: int, drafts: str) -> str | None:
    """Why `m`'s rejected draft tokens could not be rolled back exactly (then: plain decoding), or None."""
    if unsupported(caches):
        return (f"speculative decoding needs cache kinds it can roll back; model {m.name!r} has "
                f"{'+'.join(unsupported(caches))}: decoding without {drafts} (same tokens)")
    if _converts(m, 0, known + max_tokens + MAX_DRAFT_TOKENS):
        return (f"model {m.name!r} converts its KV to {m.kv_bits} bits at token {m.kv_start} during this "
                f"generation, which a rollback cannot undo: decoding without {drafts} (same tokens)")
    return None


def fallback_reason(target: LoadedModel, caches: list, draft: LoadedModel, known: int, max_tokens: int) -> str | None:
    """Why rejected tokens could not be rolled back exactly in either model (then: plain decoding), or None."""
    return (rollback_reason(target, caches, known, max_tokens, "the draft")
            or rollback_reason(draft, draft.new_caches(), known, max_tokens, "the draft"))


@dataclass
class DraftCounts:
    proposed: int = 0
    accepted: int = 0
    cached: int = 0  # draft tokens that came from the cache
    prefilled: int = 0  # draft tokens prefilled before its first proposal
    source: str | None = None

    def stats(self, name: str, k: int, fallback: str | None) -> dict:
        return {"draft": name, "num_draft_tokens": k, "draft_tokens_proposed": self.proposed,
                "draft_tokens_accepted": self.accepted,
                "draft_acceptance": round(self.accepted / self.proposed, 4) if self.proposed else None,
                "draft_cached_tokens": self.cached, "draft_prefilled_tokens": self.prefilled,
                "draft_cache_source": self.source, "draft_fallback": fallback}


class Drafter:
    """The draft model's side: its caches (lent by the tiered cache), proposals, rollback, publication.

    `held` is exactly the tokens the draft caches hold; `sync(truth)` cuts them back to the longest
    common prefix with the tokens decided so far but the last.
    """

    def __init__(self, services, model: LoadedModel, use_cache: bool, prompt_tokens: int, target_ns: str = "",
                 num_draft_tokens: int = DEFAULT_DRAFT_TOKENS):
        self.services, self.model, self.use_cache = services, model, use_cache and model.cache_notice is None
        self.target_ns = target_ns
        self.prompt_tokens = prompt_tokens
        self.caches: list = []
        self.held: list = []
        self.started = False
        self.rewind: Rewind | None = None
        self.marked = 0  # len(held) at the rewind's mark
        self.loan = None
        self.counts = DraftCounts()
        self.k = num_draft_tokens
        self.first_step: int | None = None

    @property
    def ns(self) -> str:
        return self.model.namespace

    def start(self, truth: Sequence[int]) -> None:
        """Hold every token of `truth` but its last: a cached prefix, the rest prefilled."""
        truth = list(truth)
        if self.use_cache:
            self.loan = self.services.cache.take(truth, self.ns)  # no move: the target may lend the same entry
        self.caches = self.loan.caches if self.loan else self.model.new_caches()
        self.rewind = Rewind(self.model.forward, self.caches)
        n = min(self.loan.length, len(truth) - 1) if self.loan else 0
        for c in self.caches:
            if cuttable(c) and c.offset > n:  # other kinds are lent at exact lengths only
                c.trim(c.offset - n)
        self.counts.cached, self.counts.source = n, (self.loan.source if self.loan else None)
        rest = truth[n:-1]
        if rest:
            prefill(self.model.forward, self.caches, rest, chunk=self.services.prefill_chunk)
        self.counts.prefilled = len(rest)
        self.held = truth[:-1]
        self.started = True
        if rest and self.use_cache and self.rewind.exact and self.ns != self.target_ns:
            # a state that serves its own length only (a window, recurrent state): keep this one,
            # the boundary a rerun's draft starts at (as Generation.snapshot_prompt does for the target)
            self.services.cache.put(Checkpoint.capture(self.held, self.caches, copy=True), self.ns, defer_write=True)

    def sync(self, truth: Sequence[int]) -> list:
        """Cut the caches back to what agrees with `truth`; returns the tokens of truth they lack."""
        n = 0
        limit = min(len(self.held), len(truth) - 1)  # the last token is always forwarded (a round cut
        # short at a boundary can leave the draft holding every token decided)
        while n < limit and self.held[n] == truth[n]:
            n += 1
        if n < len(self.held):
            if self.rewind.exact:  # back to before this round's forwards; the rest forwarded again
                self.rewind.restore(len(self.held) - self.marked)
                n = self.marked
            else:
                for c in self.caches:
                    c.trim(len(self.held) - n)
            del self.held[n:]
        return list(truth[n:])

    def propose(self, truth: Sequence[int], limit: int, params: SamplingParams, step: int, constraint=None) -> list:
        """Up to K draft tokens after `truth` (the loop's proposer, loop.py); the i-th drawn with the
        sampler of step + i (as the target's), under the row's constraint where it has one (then the
        target's masked samples agree as often as unconstrained ones do). The first round proposes
        nothing: the first token comes as fast as without a draft (`wants`: the draft's lookup and
        prefill come after it)."""
        k = min(self.k, limit)
        if k < 1 or (constraint is not None and not constraint.rolls_back):
            return []
        if not self.started:
            self.start(truth)
        missing = self.sync(truth)
        self.rewind.mark(())
        self.marked = len(self.held)
        out: list = []
        inputs, accepted = missing, 0
        try:
            for i in range(k):
                logits = self.model.forward(mx.array(inputs)[None], cache=self.caches)[:, -1, :]
                self.held += inputs
                if constraint is not None:
                    logits = constraint.mask(logits)
                token = sample(logits, params, step + i).item()
                out.append(token)
                if constraint is not None:
                    if token in self.model.eos_token_ids:  # the answer ends there
                        break
                    constraint.advance(token)
                    accepted += 1
                inputs = [token]
        finally:
            if constraint is not None:  # proposals are not the row's: the loop accepts what it keeps
                constraint.rollback(accepted)
        return out

    def wants(self, step: int) -> bool:
        """From the generation's second step on: its first token comes as fast as without a draft."""
        if self.first_step is None:
            self.first_step = step
        return step > self.first_step

    def stepped(self, step: int, tokens: int, seconds: float, proposed: int, pipelined: bool = False) -> None:
        pass  # a draft model proposes at every step: K is the user's

    def judged(self, proposed: int, accepted: int) -> None:
        self.counts.proposed += proposed
        self.counts.accepted += accepted

    def publish(self, truth: Sequence[int], clean: bool) -> None:
        """Publish the draft's state over the tokens decided (its own namespace, RAM then SSD).
        After an interrupt (not `clean`) only caches that can be cut to their shortest layer."""
        if not self.use_cache or not self.caches or self.ns == self.target_ns or (self.rewind.exact and not clean):
            return  # the draft is the target's model: the target's own state covers these tokens
        self.sync(truth)
        n = min([len(self.held)] + [c.offset for c in self.caches if cuttable(c)])
        for c in self.caches:
            if cuttable(c) and c.offset > n:
                c.trim(c.offset - n)
        if n >= 1:
            self.services.cache.put(Checkpoint.capture(self.held[:n], self.caches), self.ns,
                                    prompt_tokens=self.prompt_tokens)
            self.services.cache.queue_dirty()

    def release(self) -> None:
        if self.loan is not None:
            self.loan.release()
            self.loan = None
        self.caches = []
