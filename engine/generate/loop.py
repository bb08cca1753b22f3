"""The token loop: every way of generating advances its rows here.

A `Row` is one sequence: the tokens its caches do not hold yet (`pending`), how its next tokens
are chosen (its sampler's (seed, step) state, a `proposer` of drafts, a `constraint` masking what a
grammar forbids (constrain.py), forced tokens for scoring) and when it stops (end tokens,
`max_tokens`, its `on_token` callback). A `Forward` holds the caches of the rows that advance
together: one row's own caches (`OneRow`), rows over shared prefixes (batch/shared.py), rows
merged in mlx-lm's batch caches (batch/merged.py).

Each step the rows propose drafts (most propose none), the forward runs every row's pending
tokens and drafts at once, each position is sampled with its step's sampler, and a row keeps its
samples up to the first that differs from its draft: the draft only decides how many samples one
forward yields, never which, so output is what plain decoding gives. Rejected positions are cut
back (`Forward.keep`). Under a constraint each position is masked before it is sampled (after
the drafts before it) and a draft the grammar forbids is never forwarded. A row that proposes
nothing, alone in its forward, is pipelined as mlx-lm does: step i+1 is queued before token i is
read (not for the first token: on a CPU queueing a step costs most of a step, and the first token
would pay it); under a constraint its forward is queued, and its token sampled once token i is
accepted (the mask depends on it).

Forced rows (scoring) feed given tokens and keep them all; each position's log-probability and
whether it was the argmax are read, in column chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import mlx.core as mx

from .logprobs import TokenLogprob, log_softmax, pick, read
from .rewind import Rewind
from .sampling import SamplingParams, sample

if TYPE_CHECKING:
    from .constrain import Constraint


@dataclass
class DecodeResult:
    tokens: list = field(default_factory=list)  # emitted token ids
    logprobs: list = field(default_factory=list)  # TokenLogprob per emitted token, when asked for
    forwarded: int = 0  # how many emitted tokens the caches hold
    finish_reason: str = "length"  # length | eos | stop | interrupted
    greedy: bool | None = None  # forced rows: every token the model's most likely one


class Proposer(Protocol):
    """Where drafts come from: a draft model (speculative/draft.py), the row's own context
    (speculative/lookup.py)."""

    def wants(self, step: int) -> bool:
        """Whether it may propose at this step; decided before the step's token is known (the loop
        decodes plainly, pipelined, at steps where it does not)."""

    def propose(self, context: Sequence[int], limit: int, params: SamplingParams, step: int,
                constraint: "Constraint | None" = None) -> list[int]:
        """Up to `limit` tokens likely to follow `context` (every token decided so far), under the row's
        constraint if it can (its state is the row's: a proposer that advances it rolls it back)."""

    def judged(self, proposed: int, accepted: int) -> None:
        """How many of the last proposals were compared with the target's samples, and kept."""

    def stepped(self, step: int, tokens: int, seconds: float, proposed: int, pipelined: bool = False) -> None:
        """A step of the row yielded `tokens` in `seconds`, verifying `proposed` drafts (`pipelined`: a
        plain step queued before the previous token was read, what the row does where nobody proposes)."""


class Forward(Protocol):
    """The caches of the rows advancing together."""

    pipelines: bool  # one row, whose next step may be queued before its token is read

    def __call__(self, feeds, drafts: Sequence[int] = ()) -> mx.array:
        """Logits (rows, L, vocab) of each row's last positions; `feeds` is a list of token lists
        (right-aligned: row b's are logits[b, L - len(feeds[b]):]) or an array of aligned columns.
        drafts[b]: how many of row b's tokens are drafts that `keep` may cut back."""

    def keep(self, pos: int, n: int, fed: int) -> None:
        """Row `pos` keeps the first n of the `fed` tokens of the last forward (called again with a
        smaller n when the row stops early)."""

    def drop(self, positions: list[int]) -> None:
        """These rows leave."""

    def settle(self) -> None:
        """Evaluate what was queued (before anyone reads the caches, also after an interrupt)."""


class Row:
    """One sequence in the loop; `out` accumulates what it emits (also after an interrupt)."""

    def __init__(self, params: SamplingParams, pending: Sequence[int], *, eos_ids: set, first_step: int = 0,
                 context: Sequence[int] = (), proposer: Proposer | None = None,
                 on_token: Callable[[int, int], bool] | None = None, sync_at: Callable[[int], bool] | None = None,
                 into: DecodeResult | None = None, forced: Sequence[int] | None = None,
                 constraint: "Constraint | None" = None):
        self.params, self.eos_ids, self.proposer, self.constraint = params, eos_ids, proposer, constraint
        self.pending = list(pending)  # tokens the caches do not hold yet
        self.context = list(context)  # every token decided (the prompt, emitted ones, pending ones)
        self.step = first_step  # the sampler step of the next token
        self.budget = params.max_tokens - first_step
        self.on_token, self.sync_at = on_token, sync_at
        self.out = into if into is not None else DecodeResult()
        self.times: list[float] = []  # when each token was emitted
        self.forced = None if forced is None else list(forced)
        self.done = False

    @property
    def left(self) -> int:
        return self.budget - len(self.out.tokens)

    def wants(self) -> bool:
        """Whether its proposer may propose at this step."""
        return self.proposer is not None and self.left > 1 and self.proposer.wants(self.step)

    def drafts(self) -> list:
        if not self.wants():
            return []
        proposals = self.proposer.propose(self.context, self.left - 1, self.params, self.step, self.constraint)
        return list(proposals)[: self.left - 1]

    def allowed(self, proposals: list) -> list:
        """The proposals to forward: up to the first one its constraint forbids."""
        return proposals if self.constraint is None or not proposals else self.constraint.allowed(proposals)

    def sample(self, logits: mx.array, n: int, step: int, drafts: Sequence[int] = ()) -> tuple:
        """Lazy (token per position, picked log-probabilities) of the last n of `logits` (L, vocab),
        the first drawn with the sampler of `step`; under a constraint position i is masked after the
        first i drafts."""
        logits = logits[-n:]
        if self.constraint is not None:
            logits = self.constraint.mask(logits, drafts[: n - 1])
        ys = mx.concatenate([sample(logits[i : i + 1], self.params, step + i) for i in range(n)])
        picked = pick(log_softmax(logits), ys, self.params.logprobs) if self.params.logprobs is not None else None
        return ys, picked

    def boundary(self, step: int) -> bool:
        """Whether the caches must hold exactly the tokens before this step's while it is emitted."""
        return self.sync_at is not None and self.sync_at(step)

    def emit(self, tokens: list, picked, now: float) -> int:
        """Record tokens (the first at `self.step`) until the row stops; returns how many it kept."""
        kept = 0
        for i, token in enumerate(tokens):
            self.out.tokens.append(token)
            self.times.append(now)
            if picked is not None:
                self.out.logprobs += read([token], tuple(None if a is None else a[i : i + 1] for a in picked))
            kept += 1
            if token in self.eos_ids:  # an end token: not shown
                return self._finish("eos", kept)
            if self.constraint is not None:
                self.constraint.accept([token])
            if self.on_token is not None and self.on_token(token, self.step + i):
                return self._finish("stop", kept)
            if self.left <= 0:
                return self._finish("length", kept)
        return kept

    def _finish(self, reason: str, kept: int) -> int:
        self.out.finish_reason, self.done = reason, True
        return kept


def _arrays(chosen: tuple) -> list:
    ys, picked = chosen
    return [ys] + [a for a in (picked or ()) if a is not None]


def run(rows: list[Row], forward: Forward, *, on_step: Callable[[], None] | None = None,
        on_finish: Callable[[Row, int], None] | None = None, join: Callable[[int], list] | None = None,
        chunk: int = 512) -> None:
    """Advance `rows` (in `forward`'s order) until each is done. `on_finish(row, pos)` sees a finished
    row while the forward still holds it at `pos`; `join(active)` after finished rows left returns rows
    it added to the forward (after the others); `on_step()` follows every step."""
    active = list(rows)
    try:
        if any(r.forced is not None for r in active):
            _forced(active, forward, chunk)
            _drop_finished(active, forward, on_finish)
        while active:
            if forward.pipelines and len(active) == 1 and not active[0].wants():
                _pipelined(active[0], forward)
            else:
                _verify(active, forward)
            before = len(active)
            _drop_finished(active, forward, on_finish)
            if join is not None and len(active) < before:
                active += join(len(active))
            if on_step is not None:
                on_step()
    except KeyboardInterrupt:
        for r in active:
            r.out.finish_reason = "interrupted"
        raise
    finally:
        forward.settle()


def _drop_finished(active: list, forward: Forward, on_finish) -> None:
    gone = [pos for pos, r in enumerate(active) if r.done]
    if not gone:
        return
    for pos in gone:
        if on_finish is not None:
            on_finish(active[pos], pos)
    forward.drop(gone)
    active[:] = [r for r in active if not r.done]


def _verify(active: list, forward: Forward) -> None:
    """One step of every row: its pending tokens and drafts forwarded at once, samples kept up to the
    first that differs from its draft, rejected positions cut back."""
    t0 = time.perf_counter()
    proposals = [r.drafts() for r in active]
    drafts = [r.allowed(p) for r, p in zip(active, proposals)]  # (a forbidden one is judged, not forwarded)
    feeds = [r.pending + d for r, d in zip(active, drafts)]
    logits = forward(feeds, [len(d) for d in drafts])
    if any(r.constraint is not None for r in active):
        mx.async_eval(logits)  # the forward runs while the grammars compute their masks
    chosen = [r.sample(logits[b], len(d) + 1, r.step, d) for b, (r, d) in enumerate(zip(active, drafts))]
    mx.eval([a for c in chosen for a in _arrays(c)])
    now, steps = time.perf_counter(), []
    for pos, (row, d, (ys, picked)) in enumerate(zip(active, drafts, chosen)):
        samples = ys.tolist()
        agreed = 0
        while agreed < len(d) and d[agreed] == samples[agreed]:
            agreed += 1
        emit, judged = samples[: agreed + 1], len(proposals[pos])
        for i, token in enumerate(emit):  # a round ends at an end token or where a boundary is captured
            if token in row.eos_ids or row.boundary(row.step + i):
                if i < agreed:  # the proposals after it were never judged
                    emit, judged = emit[: i + 1], i
                break
        if proposals[pos]:
            row.proposer.judged(judged, len(emit) - 1)
        before, fed, timed = len(row.out.tokens), len(feeds[pos]), len(row.pending) == 1
        forward.keep(pos, len(row.pending) + len(emit) - 1, fed)  # cut back before on_token sees a token
        kept = row.emit(emit, picked, now)
        held = min(kept, len(emit) - 1)  # the caches hold the pending tokens and emit[:-1], at most what was kept
        if held < len(emit) - 1:
            forward.keep(pos, len(row.pending) + held, fed)
        row.out.forwarded = before + held
        row.context += emit[:kept]
        row.pending = emit[kept - 1 : kept] if not row.done else []
        steps.append((row, row.step, kept, len(d), timed))
        row.step += kept
    # Proposers judge by the step as a whole: rows verify together, so drafts pay only where the batch
    # yields more tokens a second with them than without.
    seconds = time.perf_counter() - t0
    tokens, proposed = sum(s[2] for s in steps), sum(s[3] for s in steps)
    for row, step, _, _, timed in steps:
        if row.proposer is not None and timed:  # (a prompt's rest forwarded with the first token is no step)
            row.proposer.stepped(step, tokens, seconds, proposed)


def _pipelined(row: Row, forward: Forward) -> None:
    """Plain decoding of one row until it stops or its proposer wants to propose again: step i+1 is
    queued before token i is read, from the second token on, except at the last step and where a
    boundary is captured."""
    step, t, timed = row.step, time.perf_counter(), len(row.pending) == 1  # (a prompt's rest is not a step)
    chosen = row.sample(forward([row.pending])[0], 1, step)
    if row.out.tokens:  # after verified steps the pending token is this run's last one: now held too
        row.out.forwarded = len(row.out.tokens)
    mx.eval(_arrays(chosen))
    while True:
        y, picked = chosen
        proposes = row.proposer is not None and row.proposer.wants(step + 1)  # then the next step is verified
        ahead = None
        if row.out.tokens and row.left > 1 and not row.boundary(step) and not proposes:
            ahead = _queue(row, forward(y[:, None])[0], step + 1)
            row.out.forwarded += 1
        token = y.item()
        row.context.append(token)
        row.step = step
        now = time.perf_counter()
        row.emit([token], picked, now)
        if row.proposer is not None and timed:
            row.proposer.stepped(step, 1, now - t, 0, pipelined=True)
        if row.done or proposes:
            row.pending = [] if ahead is not None else [token]
            row.step = step + 1
            return
        if ahead is None:
            ahead = _queue(row, forward(y[:, None])[0], step + 1)
            row.out.forwarded += 1
        chosen, step, t, timed = _sampled(row, ahead, step + 1), step + 1, now, True
        row.step, row.pending = step, []


def _queue(row: Row, logits: mx.array, step: int):
    """Step `step` queued: its token sampled at once, or under a constraint (whose mask needs the
    token before it) the logits alone, sampled by `_sampled` once that token is accepted."""
    if row.constraint is None:
        chosen = row.sample(logits, 1, step)
        mx.async_eval(_arrays(chosen))
        return chosen
    mx.async_eval(logits)
    return logits


def _sampled(row: Row, ahead, step: int) -> tuple:
    if isinstance(ahead, mx.array):
        ahead = row.sample(ahead, 1, step)
        mx.async_eval(_arrays(ahead))
    return ahead


def _forced(active: list, forward: Forward, chunk: int) -> None:
    """Rows whose tokens are given (scoring): one left-aligned forward of them all in column chunks;
    each position's log-probability of its given token and whether it was the argmax."""
    feeds = [r.pending + r.forced[:-1] for r in active]
    L = max(map(len, feeds))
    padded = mx.array([[0] * (L - len(f)) + f for f in feeds])
    targets = mx.array([[0] * (L - len(r.forced)) + r.forced for r in active])
    got, best = [], []
    for at in range(0, L, chunk):
        lp = log_softmax(forward(padded[:, at : at + chunk]))
        got.append(mx.take_along_axis(lp, targets[:, at : at + chunk, None], axis=-1)[..., 0])
        best.append(mx.argmax(lp, axis=-1))
        mx.eval(got[-1], best[-1])
    got, best = mx.concatenate(got, axis=1).tolist(), mx.concatenate(best, axis=1).tolist()
    for b, r in enumerate(active):
        n = len(r.forced)
        r.out.tokens, r.out.forwarded = list(r.forced), n - 1
        r.out.logprobs = [TokenLogprob(t, lp) for t, lp in zip(r.forced, got[b][L - n :])]
        r.out.greedy = best[b][L - n :] == r.forced
        r.context += r.forced
        r.pending, r.done, r.out.finish_reason = [], True, "length"


class OneRow:
    """One row's own caches: any model forward (a VLM's too); rejected drafts cut back exactly for
    every cache kind (rewind.py)."""

    pipelines = True

    def __init__(self, model: Callable, caches: list):
        self.model, self.caches = model, caches
        self.rewind = Rewind(model, caches)

    def __call__(self, feeds, drafts: Sequence[int] = ()) -> mx.array:
        if isinstance(feeds, mx.array):
            return self.model(feeds, cache=self.caches)
        [feed] = feeds
        if any(drafts):
            self.rewind.mark(feed)
        return self.model(mx.array(feed)[None], cache=self.caches)

    def keep(self, pos: int, n: int, fed: int) -> None:
        if n < fed:
            self.rewind.keep(n)

    def drop(self, positions: list[int]) -> None:
        pass

    def settle(self) -> None:
        mx.eval([c.state for c in self.caches])
