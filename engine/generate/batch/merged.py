"""Batch rows merged into mlx-lm's `BatchGenerator`: for models whose caches cannot share a prefix
across rows (sliding windows, recurrent layers, models attending to keys of their own making).

Each row's caches hold its prompt but the last token (its loan or a shared prefix, then its own
prefill: engine/generate/batch/run.py `_prepare`); mlx-lm merges them into its batch caches (left padded: a copy
of every row), `batch_size` rows at a time, the next row joining as one finishes. A finished row
publishes its state like a single generation; an interrupted batch publishes what its rows hold.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from ..logprobs import pick, read
from ...host.memory import DECODE_CHECK_EVERY
from ..sampling import SamplingParams, sample_logprobs


class MergedRows:
    def __init__(self, batch):
        self.batch = batch  # the BatchRun (engine/generate/batch/run.py)

    def run(self) -> None:
        from mlx_lm.generate import BatchGenerator

        b = self.batch
        size = min(b.batch_size, len(b.rows))
        gen = BatchGenerator(b.model.model, stop_tokens=[[t] for t in sorted(b.model.eos_token_ids)],
                             prefill_batch_size=size, completion_batch_size=size,
                             prefill_step_size=b.services.prefill_chunk)
        pending, active, finished = deque(b.rows), {}, []
        total = sum(r.gen.req.params.max_tokens for r in b.rows)
        try:
            for step in itertools.count():
                joined = []
                while pending and len(active) < size:  # a row joins as another finishes
                    row = pending.popleft()
                    p = row.gen.req.params
                    [uid] = gen.insert([row.tokens[-1:]], max_tokens=[p.max_tokens], caches=[b._prepare(row)],
                                       all_tokens=[row.tokens[:-1]], samplers=[_sampler(p)])
                    active[uid] = row
                    joined.append(row)
                if not active:
                    break
                responses = gen.next_generated()
                if not responses:
                    raise RuntimeError("mlx-lm's BatchGenerator stopped before every row finished")
                for row in joined:  # merged into the batch caches (a copy): the row's own caches can go
                    if row.loan is not None:
                        row.loan.release()
                now = time.perf_counter()
                for r in responses:
                    b.generated += 1
                    if self._add_token(active[r.uid], r, now):
                        if r.finish_reason is None:  # a stop string: out of the batch, with its state
                            caches, known = gen.remove([r.uid], return_prompt_caches=True)[r.uid]
                        else:
                            caches, known = r.prompt_cache, r.all_tokens
                        finished.append((active.pop(r.uid), caches, known))
                while finished:  # the others' states are kept even if a callback raises
                    row, caches, known = finished.pop(0)
                    self._publish(row, caches, known)
                    b.result(row)
                if step and step % DECODE_CHECK_EVERY == 0:
                    b.services.memory.check("decode")
                if b.on_progress is not None:
                    b.on_progress("decode", b.generated, total)
        except BaseException:
            if b.use_cache:
                self._keep_unfinished(gen, active, finished)
            raise
        finally:
            gen.close()

    @staticmethod
    def _add_token(row, r, now: float) -> bool:
        """Record one generated token; True when the row is done."""
        g = row.gen
        g.times.append(now)
        g.decoded.tokens.append(r.token)
        k = g.req.params.logprobs
        if k is not None:  # (mlx-lm's log-probabilities: of the raw logits, as `generate` reports them)
            import mlx.core as mx

            g.decoded.logprobs += read([r.token], pick(r.logprobs.reshape(1, -1), mx.array([r.token]), k))
        if r.finish_reason == "stop":  # one of the model's end tokens (not shown, as in `generate`)
            g.decoded.finish_reason = "eos"
            return True
        g.stream.add(r.token)
        if g.stream.stopped or r.finish_reason == "length":
            g.decoded.finish_reason = "stop" if g.stream.stopped else "length"
            return True
        return False

    def _publish(self, row, caches: list, known: list) -> None:
        g = row.gen
        g.stream.finish()
        g.decode_ran, g.decoded.forwarded = True, len(g.decoded.tokens)  # a batch forwards every emitted token
        if self.batch.use_cache:
            if list(known) == g.known_tokens():
                g.publish_final(caches)
            else:  # never publish a state under tokens it may not hold
                self.batch.services.events.emit("publish_skipped", ns=self.batch.ns, row=row.index,
                                                reason="token mismatch")

    def _keep_unfinished(self, gen, active: dict, finished: list) -> None:
        """An interrupted batch publishes the rows mlx-lm finished, and what its unfinished rows
        computed (cut back to the tokens they hold), so a rerun continues there."""
        for row, caches, known in finished:
            try:
                self._publish(row, caches, known)
            except Exception:
                pass  # never mask the interrupt
        try:
            extracted = gen.extract_cache(list(active))
        except Exception:
            return
        for uid, (caches, known) in extracted.items():
            try:
                active[uid].gen.publish_interrupted(list(known), caches)
            except Exception:
                pass  # never mask the interrupt


def _sampler(params: SamplingParams):
    """mlx-lm's per-row sampler: None (its greedy argmax, one call for the batch) or `generate`'s
    (seed, step) draw, one step per call."""
    if params.temperature == 0:
        return None
    steps = itertools.count()
    return lambda logprobs: sample_logprobs(logprobs, params, next(steps))
