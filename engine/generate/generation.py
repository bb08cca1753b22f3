"""One generation, start to finish: resume or look up, prefill, decode, publish.

1. An identical request that was interrupted (same namespace, prompt and
   sampling) resumes at its newest in-flight boundary (`resume.py`);
   otherwise the tiered cache lends the longest usable prefix.
2. The rest of the prompt but its last token is prefilled in chunks.
3. Decoding streams text; every `checkpoint_every` tokens the state at a
   boundary is queued for SSD, so a killed run resumes exactly.
4. The final state is published (RAM, then SSD in the background). An
   interrupted run publishes what it computed, so a rerun continues there.

All of it runs on the owner (MLX) thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import mlx.core as mx

from ..cache.tiered import TieredPromptCache
from .prefill import TextPrompt
from .text import TextStream
from .window import check_truncate, fit
from .constrain import Constraint
from .grammars import Compiled
from .loop import DecodeResult, OneRow, Row, run as run_rows
from ..errors import GenerationError
from ..events import EventBus
from .resume import InflightRecords, request_id
from ..kv.caches import always_cuttable
from ..kv.checkpoint import Checkpoint
from ..kv.tokens import token_key
from ..host.memory import DECODE_CHECK_EVERY, PressureGuard
from ..metrics import AccessTrace, GenerationMetrics, generation_stats
from ..models.registry import LoadedModel
from .sampling import SamplingParams
from .speculative.draft import DraftCounts, Drafter
from .speculative.proposers import Choice, check_lookup, choose_proposers

ONE_PASS_TOKENS = 64  # a rest of the prompt up to this long is forwarded with the first decode step


@dataclass
class Services:
    """What a generation (and a batch) needs of the engine, and nothing else of it."""

    cache: TieredPromptCache
    inflight: InflightRecords
    memory: PressureGuard
    metrics: GenerationMetrics
    events: EventBus
    trace: AccessTrace
    prefill_chunk: int
    on_published: Callable[[tuple], None]  # (namespace, tokens) of a generation's final checkpoint
    explain: Callable | None = None  # (prompt, namespace, tokens reused) -> cache/why.py's Why


@dataclass
class GenerationResult:
    text: str
    tokens: list
    stats: dict
    prompt_tokens: list = field(default_factory=list, repr=False)
    logprobs: list | None = field(default=None, repr=False)  # TokenLogprob per token, with logprobs=K
    parsed: Any = None  # under a constraint: the answer parsed (a Pydantic object, a dict, the text), None if incomplete
    reasoning: str = ""  # a chat reply's reasoning (thinking), apart from its answer in .text (chat/turn.py)
    steps: list = field(default_factory=list, repr=False)  # an agent loop's tool steps before the answer

    def __str__(self) -> str:
        return self.text


@dataclass
class Request:
    model: LoadedModel
    tokens: list
    params: SamplingParams
    session: str | None = None
    use_cache: bool = True
    on_text: Callable[[str], None] | None = None
    on_progress: Callable[[str, int, int], None] | None = None
    checkpoint_every: int | None = None
    media: Any = None  # a MediaPrompt (media/prompt.py) when the prompt holds images for a VLM
    draft: LoadedModel | None = None  # speculative decoding with this draft model (speculative/draft.py)
    num_draft_tokens: int = 0
    lookup: bool | None = None  # drafts from the context (speculative/lookup.py): None where they pay
    constraint: Compiled | None = None  # the grammar the answer follows (grammars.py, constrain.py)
    truncate: str | None = None  # a prompt past the model's window: refused, or cut "left" / "middle" (window.py)
    truncated: ClassVar[int] = 0  # prompt tokens `check` dropped
    prepared: Any = None  # passages placed (passages/run.py Placed): the start, taken as a loan; approximate,
    # so the request runs with use_cache off (nothing it computes is published)

    @property
    def ns(self) -> str:
        return self.model.namespace

    def check(self, has_ssd: bool) -> "Request":
        """Options that cannot be used (together), refused before any work."""
        check_lookup(self.lookup)
        every = self.checkpoint_every
        if every is not None and (not isinstance(every, int) or every < 1):
            raise GenerationError(f"checkpoint_every must be an integer >= 1, got {every!r}")
        if every is not None and self.params.logprobs is not None:
            raise GenerationError("logprobs are not kept by in-flight checkpoints: use checkpoint_every or logprobs")
        if every is not None and not has_ssd:
            raise GenerationError("checkpoint_every needs the SSD tier (the engine was started with ssd=False)")
        how = check_truncate(self.truncate) if self.media is None and self.prepared is None else None  # (media and
        # placed passages are never cut: past the window, they are refused)
        self.tokens, self.truncated = fit(self.model, self.tokens, self.params.max_tokens, how, session=self.session)
        return self


class Generation:
    """The state of one generation; `run()` once."""

    def __init__(self, services: Services, req: Request):
        self.services, self.req = services, req
        self.cache = services.cache
        self.prompt = req.media if req.media is not None else TextPrompt(req.model, req.tokens)
        identity = req.params.as_dict()
        if req.constraint is not None:  # a run under another grammar (or none) is another request
            identity["constraint"] = req.constraint.spec.key
        self.rid = request_id(req.ns, req.tokens, identity)
        self.emitted: list[int] = []  # tokens a resumed run had already emitted
        self.decoded = DecodeResult()  # what this run decodes (after `emitted`)
        self.decode_ran = False  # a resumed run whose record already held every token decodes nothing
        self.times: list[float] = []  # when each token was emitted
        self.stream = TextStream(req.model.tokenizer, req.params.stop)
        self.pending: list | None = None  # prompt tokens the first decode step forwards (None: the last one)
        self.converts_in_decode = False  # (set by run)
        self.drafter: Drafter | None = None  # with a draft that can roll back exactly
        self.proposers = Choice()  # where drafts came from (set when decoding starts)
        self.constraint: Constraint | None = None  # the row's grammar state (set when decoding starts)
        self.not_kept: str | None = None  # why its final state is not kept in RAM, where it is too large
        self.loop_t0 = 0.0  # when the token loop started (a short rest of the prompt goes in its first forward)

    def run(self) -> GenerationResult:
        req, cache = self.req, self.cache
        if hasattr(mx, "reset_peak_memory"):
            mx.reset_peak_memory()
        t0 = req.prepared.t0 if req.prepared is not None else time.perf_counter()
        self.services.inflight.start(self.rid)
        loan = req.prepared or (self._resume() if req.use_cache else None)
        if loan is None and req.use_cache:
            # move=True: an entry this generation will supersede hands over its buffers (not one
            # in full precision that a run converting its KV past kv_start cannot supersede)
            crosses = bool(req.model.kv_start) and len(req.tokens) + req.params.max_tokens >= req.model.kv_start
            shared = req.draft is not None and req.draft.namespace == req.ns  # the draft borrows the entry too
            loan = cache.take(req.tokens, req.ns, session=req.session, progress=req.on_progress,
                              move=not (crosses or shared))
        caches = loan.caches if loan else req.model.new_caches()
        cached = min(loan.length, len(req.tokens)) if loan else 0
        why = (self.services.explain(req.tokens, req.ns, cached)
               if req.use_cache and not self.emitted and self.services.explain else None)
        t_lookup = time.perf_counter() - t0
        head = [] if self.emitted else req.tokens[cached:]  # what the caches do not hold yet
        # A short rest of the prompt goes in one forward with the first token's (the prompt's last
        # token apart would cost another pass over the weights); windows and recurrent state need
        # the state just before the last token for their prompt snapshot: prefilled apart.
        # A run whose decode crosses kv_start keeps its prompt state in full precision apart (a
        # rerun of the cell needs it: the final state is quantized and serves only lengths >= start)
        self.converts_in_decode = bool(req.model.kv_start) and cached < len(req.tokens) < req.model.kv_start
        one_pass = (0 < len(head) <= ONE_PASS_TOKENS and self.prompt.joins_first_step and always_cuttable(caches)
                    and not self.converts_in_decode)
        self.pending = head if one_pass else None
        suffix = [] if (self.emitted or one_pass) else head[:-1]
        try:
            with cache.generating():
                t1 = time.perf_counter()
                if suffix:
                    progress = req.on_progress
                    report = (lambda done, total: progress("prefill", done, total)) if progress else None
                    self.prompt.prefill(caches, cached, len(req.tokens) - 1, chunk=self.services.prefill_chunk,
                                        progress=report)
                prefill_s = time.perf_counter() - t1
                self.services.memory.check("prefill")
                if req.use_cache and not self.emitted:
                    self.snapshot_prompt(caches)
                self.decode_tokens(caches)
        except BaseException:
            # Keep what was computed (a rerun continues from there), also the
            # state a moved entry handed over. The in-flight record stays.
            if req.use_cache:
                try:
                    self.publish_interrupted(req.tokens + self.emitted + self.decoded.tokens, caches)
                except Exception:
                    pass  # never mask the original error
            raise
        finally:
            if loan:
                loan.release()
            if self.drafter is not None:
                self._publish_draft()
        self.services.inflight.finish(self.rid)  # completion invalidates the resume point
        if req.use_cache:
            self.publish_final(caches)
        del caches
        if one_pass and self.times:  # the rest went in with the first token's forward: that forward is its prefill
            prefill_s = self.times[0] - self.loop_t0
        stats = generation_stats(
            prompt_tokens=len(req.tokens), cached=cached, source=loan.source if loan else None,
            prefilled=len(head), lookup_s=t_lookup, prefill_s=prefill_s,
            t0=t0, token_times=self.times, decode_tokens=len(self.emitted) + len(self.decoded.tokens),
            finish_reason=self.decoded.finish_reason,
            peak_memory=int(mx.get_peak_memory()) if hasattr(mx, "get_peak_memory") else None,
        )
        stats["resumed_from"] = len(self.emitted) or None
        stats["truncated_tokens"] = req.truncated  # (truncate=: prompt tokens dropped to fit the window)
        stats["context_window"] = req.model.context_window
        if why is not None:  # why the cache served no more (the footer says it where a user would wonder)
            stats.update(cache_why=why.line if why.surprising else None, cache_why_cause=why.cause)
        notes = [n for n in (self.not_kept, self.services.memory.note) if n]  # (the footer's note, %cache why's too)
        stats["cache_note"] = "; ".join(notes) or None
        if why is not None:
            why.details.extend(notes)
        stats.update(self.prompt.stats(cached, loan.source if loan else None))
        if req.prepared is not None:
            stats.update(req.prepared.stats(stats))
        if req.draft is not None:
            counts = self.drafter.counts if self.drafter else DraftCounts()
            stats.update(counts.stats(req.draft.name, req.num_draft_tokens, self.proposers.draft_fallback))
        stats.update(self.proposers.lookup_stats(req.lookup))
        parsed = self.constrained(stats)
        self.services.metrics.record(req.ns, stats)
        logprobs = self.decoded.logprobs if req.params.logprobs is not None else None
        return GenerationResult(self.stream.text, self.emitted + self.decoded.tokens, stats, list(req.tokens), logprobs,
                                parsed)

    # --- steps ---

    def _resume(self):
        """A loan at the in-flight boundary of an interrupted identical request, or None."""
        record = self.services.inflight.load(self.rid)
        if record is None:
            return None
        emitted = record["emitted"]
        boundary = tuple(self.req.tokens) + tuple(emitted[:-1])
        entry, source = self.cache.restore_exact(boundary, self.req.ns)
        if entry is None:
            self.services.events.emit("resume_failed", request=self.rid, reason="boundary checkpoint not found")
            return None
        self.services.events.emit("resume", request=self.rid, emitted=len(emitted), source=source)
        self.emitted = list(emitted)
        return self.cache.lend(entry, len(boundary), source)

    def decode_tokens(self, caches: list) -> None:
        req, emitted = self.req, self.emitted
        for token in emitted:  # a resumed generation shows what it had already said
            self._show(self.stream.add(token))
        if req.constraint is not None:  # the grammar's state is the tokens it accepted: replayed after a resume
            self.constraint = Constraint(req.constraint)
            self.constraint.accept(emitted)
        every = req.checkpoint_every
        seen = list(emitted)  # every emitted token so far, resumed ones included

        decided: dict = {}

        def boundary_due(step: int) -> bool:
            """Capture after this step's token (len(seen) == step + 1)? Decided once per step:
            decode() skips queueing ahead exactly where on_token captures. No new copy while
            the previous interval is still being written."""
            if step not in decided:
                for old in [s for s in decided if s < step - 64]:  # a speculative round asks ahead
                    del decided[old]
                decided[step] = (bool(every) and (step + 1) % every == 0 and step + 1 < req.params.max_tokens
                                 and not self.cache.durability.inflight_busy(self.rid))
            return decided[step]

        def on_token(token: int, step: int) -> bool:
            if step and step % DECODE_CHECK_EVERY == 0:
                self.services.memory.check("decode")
            self._show(self.stream.add(token))
            seen.append(token)
            if boundary_due(step) and not self.stream.stopped:
                self._queue_inflight(caches, seen)
            return self.stream.stopped

        if len(emitted) >= req.params.max_tokens:  # the killed run had emitted everything
            self.decoded.finish_reason = "length"
            self._show(self.stream.finish())
            return
        pending = self.pending or (emitted[-1:] if emitted else req.tokens[-1:])
        self.decode_ran = True
        self.proposers = choose_proposers(self.services, req, caches, len(req.tokens) + len(emitted))
        self.drafter = self.proposers.drafter
        row = Row(req.params, pending, eos_ids=req.model.eos_token_ids, first_step=len(emitted),
                  context=req.tokens + emitted, proposer=self.proposers.proposer, on_token=on_token,
                  sync_at=boundary_due, into=self.decoded, constraint=self.constraint)
        self.times = row.times
        self.loop_t0 = time.perf_counter()
        run_rows([row], OneRow(self.prompt.forward, caches))
        self._show(self.stream.finish())

    def constrained(self, stats: dict):
        """The parsed answer under a constraint (None without one, or when incomplete); its stats added."""
        if self.constraint is None:
            return None
        parsed, note = self.constraint.outcome(self.stream.text, self.decoded.finish_reason)
        stats.update(self.constraint.stats(note))
        return parsed

    def _publish_draft(self) -> None:
        """The draft's state over the tokens decided (also after an interrupt); never masks an error."""
        try:
            self.drafter.publish(self.req.tokens + self.emitted + self.decoded.tokens,
                                 clean=self.decoded.finish_reason in ("eos", "stop", "length"))
        except Exception as e:
            self.services.events.emit("notice", model=self.req.draft.name, message=f"draft state not cached: {e}")
        finally:
            self.drafter.release()

    def snapshot_prompt(self, caches: list) -> None:
        """Publish the state before the prompt's last token, where a plain cut can't recover it.

        Caches that can always be cut back make the final (or interrupted)
        checkpoint serve the prompt too. A sliding window that may wrap, or
        recurrent state, serves exact boundaries only; prefill stopped just
        before the last prompt token, which is exactly what a rerun of this
        cell, or a prompt extending it, needs. A copy: decoding goes on in
        this generation's own buffers. Written only if no later checkpoint
        covers it (`queue_dirty` after the final put).
        """
        boundary = self.req.tokens[:-1]
        if (not boundary or (always_cuttable(caches) and not self.converts_in_decode)
                or self.cache.get_exact(boundary, self.req.ns) is not None):
            return
        self.cache.put(Checkpoint.capture(boundary, caches, copy=True), self.req.ns, defer_write=True)

    def _show(self, piece: str) -> None:
        if piece and self.req.on_text:
            self.req.on_text(piece)

    def _queue_inflight(self, caches: list, seen: list) -> None:
        """Queue the state at the boundary where seen[-1] is still pending, for exact resume.

        decode() queued nothing ahead at this step (`sync_at`), so the caches
        hold exactly that boundary: every cache kind captures it as it is.
        """
        self.cache.durability.drain_completions()  # the intervals already written free their copies first
        boundary = self.req.tokens + seen[:-1]
        cp = Checkpoint.capture(boundary, caches, copy=True)
        record = {
            "namespace": self.req.ns,
            "prompt_tokens": len(self.req.tokens),
            "emitted": list(seen),
            "boundary_key": token_key(boundary),
        }
        inflight, rid = self.services.inflight, self.rid
        self.cache.durability.queue_inflight(cp, self.req.ns, rid, on_commit=lambda info: inflight.write(rid, record))

    def known_tokens(self) -> list:
        """The tokens the caches hold, as far as this run knows them (an interrupt may
        leave fewer: `publish_interrupted` cuts back to the shortest layer)."""
        if not self.decode_ran:  # a finished resume: the caches hold the boundary it restored
            return self.req.tokens + self.emitted[:-1]
        # a fresh run forwarded its last prompt token, a resumed one its pending token, at step 0
        return self.req.tokens + self.emitted + self.decoded.tokens[: self.decoded.forwarded]

    def publish_final(self, caches: list) -> None:
        self.publish_state(Checkpoint.capture(self.known_tokens(), caches))

    def publish_state(self, cp: Checkpoint) -> None:
        """Publish the generation's final state (and queue what is dirty)."""
        req = self.req
        entry = self.cache.put(cp, req.ns, session=req.session, prompt_tokens=len(req.tokens))
        self.not_kept = self.cache.ram.too_large(cp.nbytes, self.cache.has_ssd)
        if entry is not None:
            self.services.on_published((req.ns, tuple(cp.tokens)))
            self.services.trace.record(req.ns, req.tokens, len(cp.tokens), entry.checkpoint.kv_bytes / len(cp.tokens),
                                       self.services.metrics.prefill_rate.get(req.ns))
        self.cache.queue_dirty()  # the prompt snapshot too, unless the final one superseded it

    def publish_interrupted(self, known: list, caches: list) -> None:
        """Publish the state an interrupted generation reached (prefill or decode).

        An interrupt can land between layers, so the caches are cut back to
        the shortest layer and to the tokens known to be in them. Only for
        caches that can always be cut.
        """
        if not always_cuttable(caches):
            return
        n = min(min(c.offset for c in caches), len(known))
        n = self.prompt.cut(n)  # never a state that ends inside an image
        if n < 1:
            return
        for c in caches:
            c.trim(c.offset - n)
        self.cache.put(Checkpoint.capture(known[:n], caches), self.req.ns, session=self.req.session)
        self.cache.queue_dirty()
        self.services.events.emit("interrupted", ns=self.req.ns, tokens=n)
