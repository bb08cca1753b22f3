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


PREFIX_DEPTHS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


def prefix_hashes(tokens: np.ndarray) -> list[tuple[int, bytes]]:
    """(depth, hash of the first `depth` tokens) for each depth the sequence reaches."""
    raw = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    return [(d, hashlib.blake2b(raw[: 8 * d], digest_size=12).digest()) for d in PREFIX_DEPTHS if d <= len(tokens)]


class PrefixIndex:
    """Keys of token sequences, grouped by shared prefixes at a few depths.

    `candidates(prompt, min_len)` yields (depth, keys) groups, deepest shared
    prefix first: every key in a group shares at least `depth` tokens with
    the prompt. Groups too shallow to hold a match of `min_len` tokens are
    not visited. A lookup compares only candidates exactly, so it stays fast
    with thousands of sequences; only a lookup that accepts very short
    matches may visit the wide shallow groups.
    """

    def __init__(self):
        self._groups: dict[tuple, set] = {}

    def add(self, key, tokens: np.ndarray) -> None:
        for h in prefix_hashes(tokens):
            self._groups.setdefault(h, set()).add(key)

    def remove(self, key, tokens: np.ndarray) -> None:
        for h in prefix_hashes(tokens):
            group = self._groups.get(h)
            if group is not None:
                group.discard(key)
                if not group:
                    del self._groups[h]

    def candidates(self, prompt: np.ndarray, min_len: int = 1):
        floor = max((d for d in PREFIX_DEPTHS if d <= max(min_len, 1)), default=1)
        for h in reversed(prefix_hashes(prompt)):
            if h[0] >= floor and h in self._groups:
                yield self._groups[h]
