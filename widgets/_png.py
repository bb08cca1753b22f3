"""Heatmaps as PNG bytes with numpy and zlib only (no matplotlib needed).

An `ipywidgets.Image` shows PNG bytes in JupyterLab with no front-end build.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

# viridis at 9 evenly spaced stops (sRGB 0-255); linear interpolation between
_VIRIDIS = np.array(
    [
        [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
        [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
    ],
    dtype=np.float64,
)


def colormap(x: np.ndarray) -> np.ndarray:
    """Values in [0, 1] (NaN allowed: grey) -> uint8 RGB, shape x.shape + (3,)."""
    x = np.asarray(x, dtype=np.float64)
    nan = ~np.isfinite(x)
    x = np.clip(np.where(nan, 0.0, x), 0.0, 1.0) * (len(_VIRIDIS) - 1)
    i = np.minimum(np.floor(x).astype(np.int64), len(_VIRIDIS) - 2)
    f = (x - i)[..., None]
    rgb = _VIRIDIS[i] * (1 - f) + _VIRIDIS[i + 1] * f
    rgb[nan] = 128
    return np.round(rgb).astype(np.uint8)


def encode_png(rgb: np.ndarray) -> bytes:
    """uint8 array (H, W, 3) or (H, W) -> PNG bytes."""
    a = np.ascontiguousarray(rgb, dtype=np.uint8)
    if a.ndim == 2:
        color_type, a3 = 0, a[..., None]
    elif a.ndim == 3 and a.shape[2] == 3:
        color_type, a3 = 2, a
    else:
        raise ValueError(f"expected (H, W) or (H, W, 3), got {a.shape}")
    h, w = a3.shape[:2]
    if h == 0 or w == 0:
        raise ValueError("empty image")
    raw = np.concatenate([np.zeros((h, 1), np.uint8), a3.reshape(h, -1)], axis=1).tobytes()

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color_type, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )


def bin_columns(m: np.ndarray, max_cols: int) -> np.ndarray:
    """Average adjacent columns so there are at most max_cols."""
    rows, cols = m.shape
    if cols <= max_cols:
        return m
    k = -(-cols // max_cols)
    pad = (-cols) % k
    if pad:
        m = np.concatenate([m, np.full((rows, pad), np.nan)], axis=1)
    return np.nanmean(m.reshape(rows, -1, k), axis=2)


def heatmap_png(
    m: np.ndarray,
    *,
    cell_h: int | None = None,
    max_width: int = 1024,
    min_width: int = 256,
    vmin: float | None = None,
    vmax: float | None = None,
    gap: int = 0,
) -> tuple[bytes, dict]:
    """Rows x columns matrix -> (PNG bytes, meta: vmin, vmax, col_bin, size)."""
    m = np.asarray(m, dtype=np.float64)
    if m.ndim != 2 or m.size == 0:
        raise ValueError(f"heatmap needs a non-empty 2-D matrix, got {m.shape}")
    cols_in = m.shape[1]
    m = bin_columns(m, max_width)
    rows, cols = m.shape
    finite = m[np.isfinite(m)]
    lo = float(finite.min()) if vmin is None and finite.size else float(vmin or 0.0)
    hi = float(finite.max()) if vmax is None and finite.size else float(vmax if vmax is not None else 1.0)
    norm = (m - lo) / (hi - lo) if hi > lo else np.zeros_like(m) + 0.5
    img = colormap(norm)
    sx = max(1, min_width // cols) if cols < min_width else 1
    sy = cell_h or max(4, min(24, 240 // max(1, rows)))
    img = np.repeat(np.repeat(img, sy, axis=0), sx, axis=1)
    if gap and rows > 1:  # a white line between rows
        img = img.reshape(rows, sy, img.shape[1], 3)
        img[:, -gap:, :, :] = 255
        img = img.reshape(rows * sy, -1, 3)
    meta = {"vmin": lo, "vmax": hi, "col_bin": -(-cols_in // cols), "width": img.shape[1], "height": img.shape[0]}
    return encode_png(img), meta


def colorbar_png(width: int = 160, height: int = 10) -> bytes:
    ramp = np.linspace(0.0, 1.0, width)[None, :].repeat(height, axis=0)
    return encode_png(colormap(ramp))
