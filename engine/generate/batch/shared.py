"""Batch rows over shared prefixes, decoding together (`generate_batch` for plain-KV models).

Each row starts from the prefix it got (its own cache loan, or a prefix the batch shared and
prefilled once: engine/generate/batch/run.py); rows that got the same one form a group. Per layer a
`RowsCache` (kv/cascade.py) holds each group's prefix once and every row's own positions in one
left-padded tail: the rest of every row's prompt but its last token is prefilled together (left
padded to the longest rest), then the rows decode together, one token each per step, each with
its own (seed, step) sampler, stop strings and end. A finished row publishes its state (the
group's lent segments and a copy of its own positions) and leaves the batch; the others go on.
"""

from __future__ import annotations

import time

import mlx.core as mx

from ...kv.caches import lent_segments
from ...kv.cascade import joined_prefix
from ...kv.cascade_quantized import forward_rows, rows_cache
from ...kv.checkpoint import Checkpoint
from ..loop import run as run_rows


class LentRows:
    """Rows that start from lent caches, as one `RowsCache` per layer (`layers`): rows lent the
    same first segment (a document) form a group that holds it once; what else a row was lent
    (its own earlier positions) it brings into its tail (`seed`: a copy of those few positions)."""

    def __init__(self, model, lent_caches: list):
        """model: a LoadedModel; lent_caches: per row, the caches it was lent, or None."""
        self.kinds = model.new_caches()  # what each layer is (for its codec)
        groups, self.group_of, self.lent, self._seeds, self.prefix = {}, [], [], [], []
        for caches in lent_caches:
            lent = [lent_segments(c) for c in caches] if caches is not None else None
            if not lent or not lent[0]:
                self.group_of.append(None)
                self._seeds.append([None] * len(self.kinds))
                self.prefix.append(0)
                continue
            key = (id(lent[0][0].buffer), lent[0][0].length)
            if key not in groups:
                groups[key] = len(self.lent)
                self.lent.append([[segs[0]] for segs in lent])
            self.group_of.append(groups[key])
            self._seeds.append([joined_prefix(segs[1:]) for segs in lent])
            self.prefix.append(lent[0][0].length)
        none = len(self.lent)
        self.group_of = [none if g is None else g for g in self.group_of]
        layers = rows_cache(model)  # quantized KV: each row converts at kv_start
        self.layers = [layers([joined_prefix(g[l]) for g in self.lent] + [None], self.group_of)
                       for l in range(len(self.kinds))]

    def seed(self, rests: list[int]) -> None:
        """Before the first forward: row b will bring rests[b] tokens (left-padded to the longest)."""
        for l, c in enumerate(self.layers):
            c.seed([s[l] for s in self._seeds], rests)
        self._seeds = None

    def prefill(self, model, rests: list, chunk: int, progress=None) -> None:
        """Every row's `rests[b]` tokens forwarded together, left-padded, in chunks of `chunk` columns."""
        longest = max(map(len, rests), default=0)
        if not longest:
            return
        padded = mx.array([[0] * (longest - len(r)) + list(r) for r in rests])
        for at in range(0, longest, chunk):
            forward_rows(model, padded[:, at : at + chunk], self.layers)
            mx.eval([c.state for c in self.layers])
            if progress is not None:
                progress("prefill", min(at + chunk, longest), longest)

    def layers_of(self, b: int, pos: int, n: int) -> tuple:
        """Row b's (at batch position pos) first n positions, layer by layer: its group's lent
        prefix, then its own (for a checkpoint: `Checkpoint.of_layers`)."""
        group = self.group_of[b]
        lent = self.lent[group] if group < len(self.lent) else [[] for _ in self.layers]
        return tuple(c.published(self.kinds[l], pos, lent[l], n) for l, c in enumerate(self.layers))


class SharedPrefixRows:
    """One wave of rows (`start(row)` -> (its lent caches or None, positions they hold))."""

    def __init__(self, run, rows: list, starts: list):
        self.run, self.rows = run, list(rows)
        self.model = run.model
        self.lent_rows = LentRows(self.model, [caches for caches, _ in starts])
        self.layers, self.prefix = self.lent_rows.layers, self.lent_rows.prefix
        self.starts = [n if caches is not None else 0 for caches, n in starts]

    def run_wave(self) -> None:
        rests = [row.tokens[start:-1] for row, start in zip(self.rows, self.starts)]
        self.lent_rows.seed([len(r) for r in rests])
        t = time.perf_counter()
        self.lent_rows.prefill(self.model.model, rests, self.run.services.prefill_chunk, self.run.on_progress)
        spent = time.perf_counter() - t
        for row, rest in zip(self.rows, rests):
            row.prefill_s, row.prefilled = spent, len(rest) + 1
        self.run.services.memory.check("prefill")
        start = self.model.kv_start if self.model.kv_bits is not None else 0
        if self.run.use_cache and start:  # rows whose decode converts: their prompt state stays apart
            for pos, row in enumerate(self.rows):
                if len(row.tokens) <= start:
                    self._snapshot_prompt(pos)
        self._decode()

    def _snapshot_prompt(self, b: int) -> None:
        """Row b's state before its last prompt token, in full precision (the row's final state
        converts at kv_start and cannot serve a rerun of this prompt), unless the cache holds it."""
        boundary, cache, ns = self.rows[b].tokens[:-1], self.run.cache, self.run.ns
        if boundary and cache.get_exact(boundary, ns) is None:
            layers = self.lent_rows.layers_of(b, b, len(boundary))
            cache.put(Checkpoint.of_layers(boundary, layers), ns, defer_write=True)

    def _decode(self) -> None:
        self.forward = SharedRows(self.model.model, self.layers, len(self.rows))
        total = sum(r.gen.req.params.max_tokens for r in self.run.rows)

        def finished(loop_row, pos: int) -> None:  # published before leaving the batch: the others go on
            b = self.forward.order[pos]
            self._publish(b, pos, interrupted=False)
            self.run.result(self.rows[b])

        run_rows([self.run.loop_row(row) for row in self.rows], self.forward, on_finish=finished,
            on_step=lambda: self.run.step_done(total))

    def _publish(self, b: int, pos: int, *, interrupted: bool) -> None:
        """Row b's state (at batch position pos): its group's prefix and its own positions (all of
        them, or after an interrupt those every layer holds)."""
        g = self.rows[b].gen
        g.stream.finish()
        g.decode_ran = True
        if not self.run.use_cache:
            return
        known, prefix = g.known_tokens(), self.prefix[b]
        own = min(c.own_length(pos) for c in self.layers)  # (after an interrupt, what every layer holds)
        n = min(len(known), prefix + own) if interrupted else len(known)
        if n < 1 or (not interrupted and prefix + own != len(known)):
            self.run.services.events.emit("publish_skipped", ns=self.run.ns, row=self.rows[b].index,
                                          reason="token mismatch")
            return
        g.publish_state(Checkpoint.of_layers(known[:n], self.lent_rows.layers_of(b, pos, n)))

    def keep_unfinished(self) -> None:
        """After an interrupt: what each row still in the batch computed, published (no error masked)."""
        for pos, b in enumerate(self.forward.order if hasattr(self, "forward") else []):
            try:
                self._publish(b, pos, interrupted=True)
            except Exception:
                pass


class SharedRows:
    """The loop's forward over a wave's `RowsCache` layers: rows bring different numbers of tokens
    (drafts), left-padded; what a row does not keep is masked out of its tail (`RowsCache.cut`)."""

    pipelines = False

    def __init__(self, model, layers: list, rows: int):
        self.model, self.layers = model, layers
        self.order = list(range(rows))  # the wave's row of each position
        self.kept: list = []  # per row: how many of its fed tokens it keeps so far

    def __call__(self, feeds, drafts=()) -> mx.array:
        if isinstance(feeds, mx.array):  # aligned columns (the layers were seeded with each row's length)
            return forward_rows(self.model, feeds, self.layers)
        lengths = [len(f) for f in feeds]
        L = max(lengths)
        if min(lengths) < L:
            for c in self.layers:
                c.pad(lengths)
        self.kept = lengths
        return forward_rows(self.model, mx.array([[0] * (L - len(f)) + f for f in feeds]), self.layers)

    def keep(self, pos: int, n: int, fed: int) -> None:
        if n < self.kept[pos]:
            for c in self.layers:
                c.cut(pos, self.kept[pos] - n)
            self.kept[pos] = n

    def drop(self, positions: list[int]) -> None:
        going = [i for i in range(len(self.order)) if i not in set(positions)]
        self.order = [self.order[i] for i in going]
        self.kept = [self.kept[i] for i in going] if self.kept else []
        if going:
            for c in self.layers:
                c.keep(going)

    def settle(self) -> None:
        mx.eval([c.state for c in self.layers])
