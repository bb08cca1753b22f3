"""KV tensor inspection: per-layer shapes, bytes, hashes, value statistics,
and numpy export for analysis. Runs on the owner thread (it reads arrays)."""

from __future__ import annotations

import blake3

import mlx.core as mx
import numpy as np

from .checkpoint import Checkpoint
from .caches import array_names


def _layers(cp: Checkpoint, layer: int | None) -> list[int]:
    if layer is None:
        return list(range(len(cp.layers)))
    if not 0 <= layer < len(cp.layers):
        raise ValueError(f"layer {layer} is out of range: this checkpoint has layers 0..{len(cp.layers) - 1}")
    return [layer]


def kv_info(cp: Checkpoint, layer: int | None = None) -> list[dict]:
    """One row per layer and array: kind, name, shape, dtype, bytes, offset, hash, statistics."""
    rows = []
    for i in _layers(cp, layer):
        state = cp.layers[i]
        for name, a in zip(array_names(state.kind, len(state.arrays)), state.arrays):
            f = a.astype(mx.float32)
            stats = mx.stack([f.mean(), mx.sqrt(f.var()), f.min(), f.max(), mx.abs(f).max()]) if a.size else None
            host = np.ascontiguousarray(np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a))
            mean, std, lo, hi, absmax = (float(x) for x in np.asarray(stats)) if stats is not None else (0.0,) * 5
            rows.append(
                {
                    "layer": i,
                    "kind": state.kind,
                    "array": name,
                    "shape": tuple(a.shape),
                    "dtype": str(a.dtype).removeprefix("mlx.core."),
                    "bytes": int(a.nbytes),
                    "offset": state.meta.get("offset"),
                    "quantized": _quantized(state.meta),
                    "blake3": blake3.blake3(host.reshape(-1).view(np.uint8)).hexdigest()[:16],
                    "mean": mean,
                    "std": std,
                    "min": lo,
                    "max": hi,
                    "absmax": absmax,
                }
            )
    return rows


def _quantized(meta: dict) -> str:
    """How a layer's KV is quantized: "q8g64", "q8g64 from 5000" (converted at that length: its
    checkpoints serve no shorter prefix), or "" in full precision."""
    if "bits" not in meta:
        return ""
    return f"q{meta['bits']}g{meta['group_size']}" + (f" from {meta['from']}" if meta.get("from") else "")


def kv_export(cp: Checkpoint, layer: int | None = None) -> dict[str, np.ndarray]:
    """Copies as numpy arrays named 'layer{i}.{keys|values|...}'; bfloat16 becomes float32."""
    out = {}
    for i in _layers(cp, layer):
        state = cp.layers[i]
        for name, a in zip(array_names(state.kind, len(state.arrays)), state.arrays):
            if a.dtype == mx.bfloat16:
                a = a.astype(mx.float32)
            out[f"layer{i}.{name}"] = np.array(a)  # a copy: no view into cache memory escapes
    return out
