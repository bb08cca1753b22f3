"""One layer's attention over 8-bit KV on this backend, JSON on stdout: mlx-lm's quantized attention
against dequantizing the keys and values first and using MLX's fused attention (SmolLM2-135M's shape:
9 query heads, 3 KV heads, head dim 64), for prefill-like (many queries) and decode-like (one) calls.

    python benchmarks/bench_quantized_attention.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time

from common import emit

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

SHAPES = ((512, 1024), (512, 2048), (20, 2076), (1, 2096), (1, 8192))  # (queries, keys)


def timed(f, repeats: int) -> float:
    mx.eval(f())
    t = time.perf_counter()
    for _ in range(repeats):
        mx.eval(f())
    return (time.perf_counter() - t) / repeats


def case(L: int, S: int, repeats: int) -> dict:
    q = mx.random.normal((1, 9, L, 64))
    qk, qv = (mx.quantize(mx.random.normal((1, 3, S, 64)), group_size=64, bits=8) for _ in range(2))
    mx.eval(q, qk, qv)
    mask = "causal" if L > 1 else None

    def quantized():
        return quantized_scaled_dot_product_attention(q, qk, qv, scale=0.125, mask=mask, group_size=64, bits=8)

    def dequantized():
        k, v = (mx.dequantize(*x, group_size=64, bits=8) for x in (qk, qv))
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)

    return {"queries": L, "keys": S, "quantized_ms": timed(quantized, repeats) * 1e3,
            "dequantize_fused_ms": timed(dequantized, repeats) * 1e3,
            "max_difference": mx.abs(quantized() - dequantized()).max().item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    mx.random.seed(0)
    emit({"benchmark": "quantized_attention", "cases": [case(L, S, args.repeats) for L, S in SHAPES],
          "loadavg": os.getloadavg()})


if __name__ == "__main__":
    main()
