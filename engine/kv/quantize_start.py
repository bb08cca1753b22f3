"""KV quantized from token N on (mlx-lm's ``--kv-bits`` with ``--quantized-kv-start``), at exactly N.

mlx-lm converts a cache after any model call that left its offset at or past the start, so
where it converts depends on how the prompt was chunked and where a hit left off. Here every
forward that would cross N is split at N and the caches convert right there: a cold run, a
hit from a full-precision checkpoint below N and a hit from a quantized one at or past N hold
the same numbers. A converted layer remembers N (`quantized_from`); its checkpoints then
serve only lengths >= N (their minimum reusable offset, codecs.QuantizedKV), and a shorter
prompt takes an earlier full-precision checkpoint or prefills.

Kinds without a quantized form (sliding windows, recurrent state, lists of caches) stay in
full precision, as they do with kv_bits from the first token.

A forward of many tokens over quantized KV (a prefill chunk, a long rest of a prompt after a hit)
attends over the keys and values dequantized (`dequantized_attention`): MLX's CPU quantized
matmuls are about 4x slower than its fused attention there (benchmarks/bench_quantized_attention.py);
a few queries (decode, a short rest) keep mlx-lm's quantized attention, which is faster for them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base as lm_base

from .cascade import routing
from .codecs import codec, kind_of

MIN_DEQUANTIZED_QUERIES = 64  # from here on dequantize + fused attention beats quantized matmuls on a CPU


def convert(c, start: int, bits: int, group_size: int):
    """Layer `c` (at offset >= start) with its KV quantized, or `c` itself where its kind has no
    quantized form (or it is quantized already)."""
    q = codec(kind_of(c)).quantized(c, bits, group_size)
    if q is c:
        return c
    n = int(c.offset)
    if n:
        q.keys = mx.quantize(c.keys[..., :n, :], group_size=group_size, bits=bits)
        q.values = mx.quantize(c.values[..., :n, :], group_size=group_size, bits=bits)
    q.offset, q.quantized_from = n, start
    return q


class QuantizeFrom:
    """`model` as a callable that converts the caches it is given when they reach `start`."""

    def __init__(self, model, start: int, bits: int, group_size: int):
        self.model, self.start, self.bits, self.group_size = model, start, bits, group_size

    def __call__(self, inputs: mx.array, cache: list, **kwargs) -> mx.array:
        if inputs.shape[1] >= MIN_DEQUANTIZED_QUERIES and mx.default_device() == mx.cpu:
            with routing(self.model, dequantized_attention):
                return self._forward(inputs, cache, **kwargs)
        return self._forward(inputs, cache, **kwargs)

    def _forward(self, inputs: mx.array, cache: list, **kwargs) -> mx.array:
        at = self.start - min(int(c.offset) for c in cache)  # positions before the conversion
        if at <= 0 or at > inputs.shape[1]:
            self.convert(cache)  # (a no-op once converted, and below the start)
            return self.model(inputs, cache=cache, **kwargs)
        if at == inputs.shape[1]:
            out = self.model(inputs, cache=cache, **kwargs)
            self.convert(cache)
            return out
        first = self.model(inputs[:, :at], cache=cache, **kwargs)
        self.convert(cache)
        return mx.concatenate([first, self.model(inputs[:, at:], cache=cache, **kwargs)], axis=1)

    def convert(self, cache: list) -> None:
        """Convert, in place in the list, every layer that has reached the start."""
        for i, c in enumerate(cache):
            if int(c.offset) >= self.start:
                cache[i] = convert(c, self.start, self.bits, self.group_size)


def check_quantizable(model, caches: list, bits: int, group_size: int) -> str | None:
    """Why this model's KV cannot be quantized so (its head dimension and the group size), or None:
    one token through fresh full-precision `caches`, then converted."""
    try:
        mx.eval(model(mx.array([[0]]), cache=caches))
        QuantizeFrom(model, 1, bits, group_size).convert(caches)
        mx.eval([c.state for c in caches])
    except ValueError as e:
        return f"kv_bits={bits} with kv_group_size={group_size} does not fit this model's KV: {e}"
    return None


def dequantized_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's attention, except that many queries over quantized KV attend over it dequantized."""
    bits = getattr(cache, "bits", None)
    if bits is None or sinks is not None or queries.shape[2] < MIN_DEQUANTIZED_QUERIES:
        return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    k, v = (mx.dequantize(*x, group_size=cache.group_size, bits=bits).astype(queries.dtype) for x in (keys, values))
    return _ORIGINAL(queries, k, v, cache=None, scale=scale, mask=mask)


_ORIGINAL = lm_base.scaled_dot_product_attention
