"""Batch rows merged into mlx-lm's batch caches: for models whose caches cannot share a prefix across
rows (sliding windows, recurrent layers, models attending to keys of their own making).

Each row's caches hold its prompt but the last token (its loan or a shared prefix, then its own
prefill: batch/run.py `_prepare`); mlx-lm's cache classes merge them (`merge`: left padded, a copy of
every row), `batch_size` rows at a time, the next row joining (`extend`) as one finishes. The rows
advance through the one token loop (generate/loop.py); a finished row's caches are extracted and it
publishes its state like a single generation; an interrupted batch publishes what its rows hold.
"""

from __future__ import annotations

from collections import deque

import mlx.core as mx

from ..loop import Row, run as run_rows


class MergedCaches:
    """The loop's forward over mlx-lm's batch caches (one token per row and step)."""

    pipelines = False

    def __init__(self, model):
        self.model, self.caches, self.rows = model, [], []  # rows: the batch's rows, in the caches' order

    def add(self, rows: list, caches: list) -> None:
        from mlx_lm.generate import _extend_cache, _merge_caches  # (mlx-lm's own batching of every cache kind)

        self.caches = _extend_cache(self.caches, _merge_caches(caches))
        self.rows += rows

    def __call__(self, feeds, drafts=()) -> mx.array:
        if any(drafts) or any(len(f) != 1 for f in feeds):
            raise ValueError("merged batch rows forward one token each")
        return self.model(mx.array(feeds), cache=self.caches)

    def keep(self, pos: int, n: int, fed: int) -> None:
        assert n == fed, "merged batch rows cannot cut back"

    def extract(self, pos: int) -> list:
        return [c.extract(pos) for c in self.caches]

    def drop(self, positions: list[int]) -> None:
        keep = [i for i in range(len(self.rows)) if i not in set(positions)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.caches = []
        else:
            for c in self.caches:
                c.filter(keep)

    def settle(self) -> None:
        mx.eval([c.state for c in self.caches])


class MergedRows:
    def __init__(self, batch):
        self.batch = batch  # the BatchRun (batch/run.py)

    def run(self) -> None:
        b = self.batch
        size = min(b.batch_size, len(b.rows))
        forward = MergedCaches(b.model.model)
        waiting = deque(b.rows)
        total = sum(r.gen.req.params.max_tokens for r in b.rows)

        def join(active: int) -> list:
            """Rows that join as others finish: prepared, merged into the batch (a copy), their own caches let go."""
            joining = [waiting.popleft() for _ in range(min(size - active, len(waiting)))]
            if not joining:
                return []
            loops = [b.loop_row(row) for row in joining]
            forward.add(joining, [b._prepare(row) for row in joining])
            for row in joining:
                if row.loan is not None:
                    row.loan.release()
            return loops

        def finished(loop_row: Row, pos: int) -> None:
            row = forward.rows[pos]
            self._publish(row, forward.extract(pos))
            b.result(row)

        def stepped() -> None:
            b.step_done(total)

        try:
            run_rows(join(0), forward, on_finish=finished, on_step=stepped, join=join)
        except BaseException:
            if b.use_cache:
                self._keep_unfinished(forward)
            raise

    def _publish(self, row, caches: list) -> None:
        g = row.gen
        g.stream.finish()
        g.decode_ran = True
        if self.batch.use_cache:
            g.publish_final(caches)

    def _keep_unfinished(self, forward: MergedCaches) -> None:
        """An interrupted batch publishes what its unfinished rows computed (cut back to the tokens
        they hold), so a rerun continues there."""
        for pos, row in enumerate(forward.rows):
            try:
                row.gen.publish_interrupted(row.gen.known_tokens(), forward.extract(pos))
            except Exception:
                pass  # never mask the interrupt
