"""Audio in the prompt: reading a recording as the model's processor does.
prompt.py puts recordings in the prompt beside images and videos (the same
encoder-output objects and prefix keys).

- **Reading**: a file goes through mlx-vlm's own `load_audio` (miniaudio),
  resampled to the feature extractor's rate, so the waveform is the one
  mlx-vlm's generate would use; a 1-D float array in [-1, 1] is taken as that
  waveform at that rate.
- **Identity**: prompt.py hashes the feature extractor's output (the raw
  float32 log-mel features) with the extractor's settings, the audio tower's
  weights and `MEDIA_REVISION`; `Recording.parts` adds the rate and length.
- **Features** (`prepare`): an exact-key object under the waveform's content
  hash (with the extractor's settings), so a follow-up, in RAM or after a
  restart, skips the extractor's STFT; the prompt's audio placeholders are
  expanded as the processor expands them (its own token count per recording).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..generate.sampling import GenerationError


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


FEATURES_LABEL = "audio features"


def prepare(family, text: str, recordings: list, objects) -> tuple[str, list]:
    """(text with each audio placeholder expanded to its tokens, (1, frames, mels) features per recording)."""
    proc = family.processor
    runs = [proc.boa_token + proc.audio_token * proc._compute_audio_num_tokens(r.waveform, r.rate) + proc.eoa_token
            for r in recordings]
    found = re.findall(re.escape(proc.audio_token), text)
    if len(found) != len(runs):
        raise GenerationError(f"the prompt has {len(found)} audio placeholder(s) for {len(runs)} recording(s)")
    at = iter(runs)
    return re.sub(re.escape(proc.audio_token), lambda _: next(at), text), [features(family, r, objects) for r in recordings]


def features(family, rec: Recording, objects) -> mx.array:
    """The extractor's log-mel features of one recording (its valid frames): from the object cache, else computed."""
    from ..models.vlm import MEDIA_REVISION, digest

    key = ("audio-features", digest(MEDIA_REVISION, family.audio_processor_id, rec.rate,
                                    memoryview(rec.waveform).cast("B")))
    value, _ = objects.lookup(key) if objects is not None else (None, None)
    if isinstance(value, mx.array):
        return value
    out = family.processor.feature_extractor([rec.waveform], sampling_rate=rec.rate, return_attention_mask=True)
    valid = int(np.asarray(out["input_features_mask"])[0].sum())
    feats = mx.array(np.asarray(out["input_features"])[:1, :valid])
    if objects is not None:
        objects.put(key, feats, label=FEATURES_LABEL)
    return feats


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
