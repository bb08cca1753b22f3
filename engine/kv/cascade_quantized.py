"""Batch rows of a model with quantized KV (kv_bits, from token kv_start on) over shared prefixes.

mlx-lm's `BatchGenerator` has no `kv_bits`; here a `QuantizedRowsCache` is a `RowsCache`
(cascade.py) whose rows each convert at exactly kv_start, at their own step (the batch splits a
forward where a row reaches it: `until_conversion`). As with one row (quantize_start.py), from
then on the row attends over its KV as quantized: the scores use the dequantized values, which
is what mlx-lm's quantized attention computes, and what `dequantized_attention` attends over.

Quantization works position by position (groups along the head dimension), so:
- every position written is quantized as it comes (`qtails`, for the row's published state:
  quantizing dequantized values again would not give the same bits);
- a converted row's tail holds the dequantized values; an unconverted row's, the full-precision;
- a group's prefix is held once in each form its rows need: full precision, and quantized
  (dequantized for the scores; the quantized arrays for a converted row's published state).
A quantized prefix (a checkpoint past kv_start) is lent quantized: its rows start converted.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from .cascade import RowsCache, grown
from .caches import published_layer, quantized_like


def rows_cache(model):
    """The cache class of a batch's layers for `model` (a LoadedModel): each row converting at
    exactly kv_start with quantized KV, plain rows otherwise."""
    if model.kv_bits is None:
        return RowsCache
    return partial(QuantizedRowsCache, start=model.kv_start, bits=model.kv_bits, group_size=model.kv_group_size)


def forward_rows(model, tokens: mx.array, layers: list) -> mx.array:
    """`model` over the rows' next tokens; with quantized KV split where a row reaches its start,
    which converts there (as one row's QuantizeFrom does)."""
    first = layers[0]
    if not isinstance(first, QuantizedRowsCache):
        return model(tokens, cache=layers)
    outs, at = [], 0
    while at < tokens.shape[1]:
        for c in layers:
            c.convert_due()
        n = min(tokens.shape[1] - at, first.until_conversion() or tokens.shape[1])
        outs.append(model(tokens[:, at : at + n], cache=layers))
        at += n
    for c in layers:  # a forward that ended at the start: converted before anything reads it
        c.convert_due()
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)


class QuantizedRowsCache(RowsCache):
    """One layer of a batch of rows whose KV is quantized from token `start` on."""

    def __init__(self, prefixes: list, group_of: list[int], *, start: int, bits: int, group_size: int):
        """prefixes: per group its (keys, values), or its quantized (packed, scales, biases) of each, or None."""
        self.start, self.kv_bits, self.group_size = start, bits, group_size
        self.q_prefix = {g: tuple(p) for g, p in enumerate(prefixes) if p is not None and len(p) == 6}
        super().__init__([None if g in self.q_prefix else p for g, p in enumerate(prefixes)], group_of)
        self.prefix_len = [int(self.q_prefix[g][0].shape[2]) if g in self.q_prefix else n
                           for g, n in zip(group_of, self.prefix_len)]
        self.origin = list(self.prefix_len)
        self.converted = [g in self.q_prefix for g in group_of]
        self.qtails: tuple = ()  # every tail position quantized: (packed, scales, biases) of keys, of values
        self._fq: dict = {}  # group -> its prefix quantized, dequantized to float32

    # --- quantized and dequantized ---

    def _quantize(self, keys, values) -> tuple:
        return (*mx.quantize(keys, group_size=self.group_size, bits=self.kv_bits),
                *mx.quantize(values, group_size=self.group_size, bits=self.kv_bits))

    def _dequantize(self, q: tuple, dtype=None) -> tuple:
        out = tuple(mx.dequantize(*q[i : i + 3], group_size=self.group_size, bits=self.kv_bits) for i in (0, 3))
        return out if dtype is None else tuple(a.astype(dtype) for a in out)

    def _quantized_prefix(self, g: int) -> tuple:
        if g not in self.q_prefix:
            self.q_prefix[g] = self._quantize(*self.prefixes[g])
        return self.q_prefix[g]

    # --- writes ---

    def seed(self, seeds: list, rests: list[int]) -> None:
        """As RowsCache.seed; a seed from a quantized loan (6 arrays) comes in dequantized."""
        quantized = [None if x is None else tuple(x) if len(x) == 6 else self._quantize(*x) for x in seeds]
        super().seed([None if x is None else self._dequantize(x) if len(x) == 6 else x for x in seeds], rests)
        if self.T:  # the seeds were placed at the end of positions [0, T): their quantized forms too
            self.qtails = grown((), 0, self.T, next(q for q in quantized if q is not None), self.rows)
            for b, q in enumerate(quantized):
                if q is not None:
                    for buf, a in zip(self.qtails, q):
                        buf[b : b + 1, :, self.T - a.shape[2] : self.T, :] = a

    def update_and_fetch(self, keys, values):
        n, T = keys.shape[2], self.T
        q = self._quantize(keys, values)
        self.qtails = grown(self.qtails, T, n, q, self.rows)
        for buf, a in zip(self.qtails, q):
            buf[..., T : T + n, :] = a
        if any(self.converted):
            conv = mx.array(self.converted)[:, None, None, None]
            keys, values = (mx.where(conv, d, x) for d, x in zip(self._dequantize(q, keys.dtype), (keys, values)))
        return super().update_and_fetch(keys, values)

    # --- conversion at exactly `start`, row by row ---

    def until_conversion(self) -> int | None:
        """Positions the next forward may write before an unconverted row reaches the start (None: no limit)."""
        left = [self.start - o - self.T for o, c in zip(self.origin, self.converted) if not c]
        left = [n for n in left if n > 0]
        return min(left) if left else None

    def convert_due(self) -> None:
        """Rows whose next position is the start or past it: their tail becomes its quantized values."""
        if all(self.converted):  # (every decode step asks)
            return
        for b, (o, c) in enumerate(zip(self.origin, self.converted)):
            if not c and o + self.T >= self.start:
                self.converted[b] = True
                if self.T:
                    deq = self._dequantize(tuple(t[b : b + 1, :, : self.T, :] for t in self.qtails))
                    for buf, a in zip(self.tails, deq):
                        buf[b : b + 1, :, : self.T, :] = a.astype(buf.dtype)

    # --- reads ---

    def _prefix_parts(self):
        """Per group: its unconverted rows over the full-precision prefix, its converted rows over
        the quantized one (dequantized)."""
        for g in range(len(self.prefixes)):
            rows = [i for i, x in enumerate(self.group_of) if x == g]
            for convert in (False, True):
                part = [i for i in rows if self.converted[i] == convert]
                if part and self.prefix_len[part[0]]:  # (a quantized prefix's rows are all converted)
                    yield part, (self._fq_prefix(g) if convert else self._prefix32(g))

    def _fq_prefix(self, g: int) -> tuple:
        if g not in self._fq:
            self._fq[g] = self._dequantize(self._quantized_prefix(g), mx.float32)
        return self._fq[g]

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        self.converted = [self.converted[i] for i in rows]
        idx = mx.array(rows)
        self.qtails = tuple(t[idx] for t in self.qtails) if self.qtails else ()

    def published(self, like, row: int, lent: list, n: int):
        """A converted row: a quantized layer (its lent segments if they are quantized, else its
        prefix quantized, then its own positions quantized) that serves lengths >= start."""
        if not self.converted[row]:
            return super().published(like, row, lent, n)
        own_q = self.row_tail(row, n - self.prefix_len[row], self.qtails)
        g = self.group_of[row]
        if lent and len(lent[0].arrays) != 6:  # a full-precision prefix: quantized, a copy of its own
            pq = self._quantized_prefix(g)
            own_q = tuple(mx.concatenate([p, a], axis=2) for p, a in zip(pq, own_q)) if own_q else pq
            lent = []
        meta = {"group_size": self.group_size, "bits": self.kv_bits, **({"from": self.start} if self.start else {})}
        return published_layer(quantized_like(like, self.kv_bits, self.group_size), lent, own_q, n, meta)
