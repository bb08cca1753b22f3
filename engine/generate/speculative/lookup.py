"""Drafts from the context (prompt lookup): no draft model, the row's own tokens propose.

The latest earlier occurrence of the row's last n tokens (n from MAX_NGRAM down to MIN_NGRAM) proposes
the tokens that followed it (read on into the proposal itself where they run out, as LZ77 copies do,
so a repeating stretch proposes a whole round): fields copied out of a document, a paragraph rewritten
with one change, code edited in place. The token loop (generate/loop.py) verifies proposals as it verifies a draft
model's, so the output is plain decoding's whatever is proposed.

Whether it pays is measured, not assumed: a verify forward of k+1 tokens costs more than a decode
step (little more for a plain-KV model on a GPU, about 4x on hybrid models where recurrent layers are
restored and the kept tokens forwarded again), and a row that may propose is not pipelined (its next
step cannot be queued before its token is read). So the proposer compares the seconds per token of
every step it takes part in (rounds with proposals and the unpipelined steps where nothing matched)
with those of plain pipelined steps, what the row does without it; it starts paused for PROBE steps
to learn the latter. When taking part yields fewer tokens a second it stops proposing for a while
(doubling the pause each time it is still behind), and the loop decodes plainly (pipelined)
meanwhile; so it does after MISSES steps in a row where nothing matched (text that copies nothing).
Where the row is never pipelined (batches, a draft model beside it) its unpipelined steps without
proposals are the reference. k follows the acceptance: doubled after a round kept every proposal,
cut to what was kept (plus one) otherwise.
"""

from __future__ import annotations

from typing import Sequence

MIN_NGRAM, MAX_NGRAM = 2, 4  # a single token matches everywhere: too weak a signal to pay a verify
FIRST_K, MAX_K = 4, 16
EMA = 0.2  # weight of the newest step in the running means
JUDGE_AFTER = 6  # steps taken part in before the rates are compared
PROBE = 3  # plain pipelined steps at the start: the rate to beat
BEHIND = 0.97  # lookup rounds slower than this fraction of plain steps: pause
FIRST_PAUSE, MAX_PAUSE = 16, 512  # steps without proposals before trying again
MISSES = 8  # steps in a row without a match: the text is not copying, decode plainly (pipelined) a while


class _Mean:
    """A running mean that weighs recent steps more (an exponential moving average)."""

    def __init__(self):
        self.value, self.n = None, 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + EMA * (x - self.value)
        self.n += 1


class ContextLookup:
    """The loop's proposer (loop.Proposer) drawing drafts from the row's own context."""

    name = "lookup"

    def __init__(self, *, forced: bool = False):
        self.forced = forced  # the user asked for it: propose even where it does not pay
        self.index: list[dict] = [dict() for _ in range(MAX_NGRAM + 1)]  # n -> {n tokens: where they ended}
        self.indexed = 0  # context positions whose n-grams are indexed
        self.k = FIRST_K
        self.paused_until, self.pause = (0 if forced else PROBE), FIRST_PAUSE
        self.proposed = self.accepted = self.rounds = 0
        # seconds per token: plain pipelined steps, unpipelined steps without proposals, every step taken part in
        self.plain, self.unproposed, self.drafting = _Mean(), _Mean(), _Mean()
        self.judged_rounds = 0
        self.misses = 0  # steps in a row where nothing matched

    def _grow(self, context: Sequence[int]) -> None:
        """Index every n-gram whose next token is known (the context's last n tokens are the query)."""
        for end in range(self.indexed, len(context) - 1):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end + 1 >= n:
                    self.index[n][tuple(context[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, len(context) - 1)

    def wants(self, step: int) -> bool:
        """Whether it may propose at this step (known before the step's token: the loop pipelines otherwise)."""
        return step >= self.paused_until

    def propose(self, context: Sequence[int], limit: int, params, step: int, constraint=None) -> list:
        """What followed the latest earlier occurrence of the context's end (a constraint's row cuts it at
        the first token its grammar forbids)."""
        if not self.wants(step):
            return []
        self._grow(context)
        k = min(self.k, limit)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            end = self.index[n].get(tuple(context[-n:])) if len(context) >= n else None
            if end is not None and end + 1 < len(context):  # what followed, read on into the proposal itself where it runs out (a
                out = []        # repeating stretch of period p proposes k tokens, not p)
                for i in range(k):
                    at = end + 1 + i
                    out.append(context[at] if at < len(context) else out[at - len(context)])
                self.misses = 0
                return out
        self.misses += 1
        if self.misses >= MISSES and not self.forced:
            self._pause(step)
        return []

    def _pause(self, step: int) -> None:
        self.paused_until, self.pause = step + self.pause, min(self.pause * 2, MAX_PAUSE)
        self.judged_rounds, self.drafting, self.misses = 0, _Mean(), 0  # judged afresh when it tries again

    def judged(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.rounds += 1
        self.k = min(self.k * 2, MAX_K) if accepted == proposed else max(1, accepted + 1)

    def stepped(self, step: int, tokens: int, seconds: float, proposed: int, pipelined: bool = False) -> None:
        """A step of the row took `seconds` and yielded `tokens` (`proposed` drafts were verified)."""
        if tokens < 1 or seconds <= 0:
            return
        if pipelined:
            self.plain.add(seconds / tokens)
            return
        self.drafting.add(seconds / tokens)
        if not proposed:
            self.unproposed.add(seconds / tokens)
        if self.forced:
            return
        self.judged_rounds += 1
        reference = self.plain.value if self.plain.value is not None else self.unproposed.value
        if (self.judged_rounds >= JUDGE_AFTER and reference is not None
                and self.drafting.value * BEHIND > reference):  # fewer tokens a second than plain steps
            self._pause(step)

    def speedup(self) -> float | None:
        """Measured tokens a second with proposals against without, or None before both are known."""
        reference = self.plain.value if self.plain.value is not None else self.unproposed.value
        if reference is None or self.drafting.value is None:
            return None
        return round(reference / self.drafting.value, 3)

    def stats(self) -> dict:
        return {"lookup_drafts_proposed": self.proposed, "lookup_drafts_accepted": self.accepted,
                "lookup_drafts_acceptance": round(self.accepted / self.proposed, 4) if self.proposed else None,
                "lookup_drafts_rounds": self.rounds, "lookup_drafts_speedup": self.speedup()}
