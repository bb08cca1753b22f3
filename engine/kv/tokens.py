"""Token prefixes: arrays, common-prefix length, and the stable key of a token sequence."""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def as_token_array(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    k = min(len(a), len(b))
    if k == 0:
        return 0
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if len(diff) else k


def token_key(tokens: Sequence[int]) -> str:
    """SHA-256 of the little-endian int64 token ids: file names and record keys."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()
