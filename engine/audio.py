"""Audio in the prompt: reading a recording as the model's processor does.
media.py puts recordings in the prompt beside images and videos (the same
encoder-output objects and prefix keys).

- **Reading**: a file goes through mlx-vlm's own `load_audio` (miniaudio),
  resampled to the feature extractor's rate, so the waveform is the one
  mlx-vlm's generate would use; a 1-D float array in [-1, 1] is taken as that
  waveform at that rate.
- **Identity**: media.py hashes the feature extractor's output (the raw
  float32 log-mel features) with the extractor's settings, the audio tower's
  weights and `MEDIA_REVISION`; `Recording.parts` adds the rate and length.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .sampling import GenerationError


@dataclass
class Recording:
    waveform: np.ndarray  # float32 mono at `rate`: what the processor is given
    rate: int
    source: str  # the path, or "array"

    @property
    def parts(self) -> tuple:
        return ("audio", self.rate, len(self.waveform))


def rate_of(processor) -> int:
    return int(getattr(getattr(processor, "feature_extractor", None), "sampling_rate", 16000))


def extractor_identity(processor) -> str:
    """The feature extractor's settings as they take effect (its scalar and list attributes)."""
    from .vlm import digest

    fe = getattr(processor, "feature_extractor", None)
    plain = {k: v for k, v in vars(fe).items() if isinstance(v, (int, float, str, bool, list, tuple, type(None)))} \
        if fe is not None else {}
    return digest(type(fe).__name__, json.dumps(plain, sort_keys=True, default=str))


def load_recording(item: Any, index: int, processor) -> Recording:
    """A Recording from an audio file (WAV, FLAC, MP3, ...) or a 1-D float waveform at the extractor's rate."""
    if isinstance(item, Recording):
        return item
    where, rate = f"audio {index + 1}", rate_of(processor)
    if isinstance(item, (str, os.PathLike)):
        from mlx_vlm.utils import load_audio

        path = Path(item).expanduser()
        if not path.is_file():
            raise GenerationError(f"{where}: no such audio file: {path}")
        try:
            wave = np.asarray(load_audio(str(path), sr=rate), dtype=np.float32)
        except Exception as e:  # noqa: BLE001 - the decoder's own errors vary by format
            raise GenerationError(f"{where}: {path} is not audio the processor can read ({type(e).__name__}: {e})") \
                from None
        if wave.ndim != 1 or wave.size == 0:
            raise GenerationError(f"{where}: {path} decoded to no mono samples")
        return Recording(np.ascontiguousarray(wave), rate, str(path))
    if isinstance(item, mx.array):
        item = np.array(item)
    if isinstance(item, np.ndarray):
        if item.ndim != 1 or item.size == 0 or item.dtype.kind != "f":
            raise GenerationError(f"{where}: an audio array must be a 1-D float waveform at {rate} Hz, "
                                  f"got {item.dtype} {item.shape}")
        if not np.isfinite(item).all() or np.abs(item).max() > 1:
            raise GenerationError(f"{where}: an audio array must hold values in [-1, 1]")
        return Recording(np.ascontiguousarray(item.astype(np.float32)), rate, "array")
    raise GenerationError(f"{where}: expected an audio file path or a 1-D float array, got {type(item).__name__}")
