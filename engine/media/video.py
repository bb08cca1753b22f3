"""Videos in the prompt: reading a clip, sampling its frames as the model's
processor does, and what identifies it. prompt.py puts clips in the prompt
beside images (the same encoder-output objects and prefix keys).

- **Sampling**: a file goes through mlx-vlm's own `load_video` (OpenCV) with
  the sampling mlx-vlm resolves (the caller's fps / max_frames, then the
  processor's defaults, then mlx-vlm's), so the frames are the ones mlx-vlm's
  generate would see. An array, a .npy/.npz file or a directory of frame
  images is already decoded: as in mlx-vlm, its frames are taken as they are,
  at the requested (else default) fps; a max_frames below its length picks
  that many evenly spaced frames (frame_factor-rounded, as `load_video` does).
- **Identity** (`Clip.parts`): the sampled rate and source frame indices (the
  clip's timestamps) beside the preprocessed pixels, grid, processor
  configuration and encoder weights that prompt.py hashes: the same frames at
  another fps are another clip.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..generate.sampling import GenerationError

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


@dataclass
class Clip:
    frames: np.ndarray  # (T, H, W, 3) uint8: what the processor is given
    fps: float  # the sampled rate (mlx-vlm's VideoMetadata.sampled_fps)
    indices: tuple  # the source frame index of each sampled frame
    source: str  # the path, or "array"

    @property
    def parts(self) -> tuple:
        return ("video", f"{self.fps!r}", self.indices)

    def describe(self) -> str:
        return f"{self.source}: {len(self.indices)} frames at {self.fps:g} fps"


def sampling(processor, fps: float | None, max_frames: int | None):
    """mlx-vlm's resolved VideoSampling: the caller's settings, then the processor's, then its defaults."""
    from mlx_vlm.utils import resolve_video_sampling

    if fps is not None and not (isinstance(fps, (int, float)) and math.isfinite(fps) and fps > 0):
        raise GenerationError(f"fps must be a positive number, got {fps!r}")
    if max_frames is not None and (not isinstance(max_frames, int) or isinstance(max_frames, bool) or max_frames < 2):
        raise GenerationError(f"max_frames must be an integer >= 2, got {max_frames!r}")
    given = {k: v for k, v in (("fps", fps), ("max_frames", max_frames)) if v is not None}
    return resolve_video_sampling(processor, given)


def load_clip(item: Any, index: int, processor, fps: float | None = None, max_frames: int | None = None) -> Clip:
    """A Clip from a video file, a directory of frames, a .npy/.npz file or a (T, C, H, W) array."""
    if isinstance(item, Clip):
        return item
    s = sampling(processor, fps, max_frames)
    where = f"video {index + 1}"
    if isinstance(item, (str, os.PathLike)):
        path = Path(item).expanduser()
        if path.is_dir():
            return _sample(_frames_dir(path, where), s, f"{where} ({path})", str(path))
        if not path.is_file():
            raise GenerationError(f"{where}: no such video file or frame directory: {path}")
        if path.suffix.lower() in (".npy", ".npz"):
            return _sample(_frames_npy(path, where), s, f"{where} ({path})", str(path))
        return _decode(path, s, where)
    if isinstance(item, mx.array):
        item = np.array(item)
    if isinstance(item, np.ndarray):
        return _sample(_tchw(item, where), s, where, "array")
    raise GenerationError(f"{where}: expected a video path, a frame directory or a (T, C, H, W) array, "
                          f"got {type(item).__name__}")


def _decode(path: Path, s, where: str) -> Clip:
    from mlx_vlm.utils import load_video

    try:
        arr, meta = load_video(str(path), s)
    except (ValueError, OSError) as e:
        raise GenerationError(f"{where}: {path} is not a video OpenCV can read "
                              f"(fps {s.fps:g}, frames {s.min_frames}..{s.max_frames}): {e}") from None
    frames = np.ascontiguousarray(arr.transpose(0, 2, 3, 1))
    return Clip(frames, float(meta.sampled_fps), tuple(int(i) for i in meta.frames_indices), str(path))


def _sample(frames: np.ndarray, s, where: str, source: str) -> Clip:
    """Decoded frames (T, H, W, 3): all of them at s.fps, or max_frames evenly spaced."""
    total, n = frames.shape[0], frames.shape[0]
    if total > s.max_frames:
        n = max(s.frame_factor, math.floor(s.max_frames / s.frame_factor) * s.frame_factor)
    indices = np.linspace(0, total - 1, n).round().astype(int) if n < total else np.arange(total)
    return Clip(np.ascontiguousarray(frames[indices]), float(s.fps) * n / total,
                tuple(int(i) for i in indices), source)


def _tchw(a: np.ndarray, where: str) -> np.ndarray:
    """(T, C, H, W) frames with C in 1, 3, 4 -> (T, H, W, 3) uint8 (floats in [0, 1] as images are)."""
    if a.ndim != 4 or a.shape[1] not in (1, 3, 4) or 0 in a.shape:
        raise GenerationError(f"{where}: a video array must be (T, C, H, W) with C 1, 3 or 4, got {a.shape}")
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
            raise GenerationError(f"{where}: a float video array must hold values in [0, 1]")
        a = np.round(a * 255)
    elif a.dtype.kind not in "ui" or a.min() < 0 or a.max() > 255:
        raise GenerationError(f"{where}: an integer video array must hold values in 0..255")
    a = a.astype(np.uint8).transpose(0, 2, 3, 1)
    a = np.repeat(a, 3, axis=-1) if a.shape[-1] == 1 else a[..., :3]
    return np.ascontiguousarray(a)


def _frames_npy(path: Path, where: str) -> np.ndarray:
    try:
        data = np.load(path, allow_pickle=False)
        if isinstance(data, np.lib.npyio.NpzFile):
            if len(data.files) != 1:
                raise GenerationError(f"{where}: {path} must hold one (T, C, H, W) array, it holds {data.files}")
            data = data[data.files[0]]
    except (ValueError, OSError) as e:
        raise GenerationError(f"{where}: {path} is not a readable .npy/.npz array ({e})") from None
    return _tchw(data, f"{where} ({path})")


def _frames_dir(path: Path, where: str) -> np.ndarray:
    """The directory's frame images in name order, all of one size."""
    from PIL import Image, UnidentifiedImageError

    files = sorted(p for p in path.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
    if not files:
        raise GenerationError(f"{where}: {path} holds no frame images ({', '.join(FRAME_SUFFIXES)})")
    frames = []
    for f in files:
        try:
            with Image.open(f) as im:
                frames.append(np.asarray(im.convert("RGB")))
        except (UnidentifiedImageError, OSError) as e:
            raise GenerationError(f"{where}: {f} is not a readable image ({e})") from None
    if len({fr.shape for fr in frames}) != 1:
        raise GenerationError(f"{where}: the frames in {path} are not all one size")
    return np.stack(frames)
