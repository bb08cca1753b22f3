"""Token prefixes: arrays, common-prefix length, and the stable key of a token sequence."""

from __future__ import annotations

import bisect
import hashlib
from typing import Sequence

import blake3
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
    """BLAKE3 of the little-endian int64 token ids: file names and record keys."""
    return blake3.blake3(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


def legacy_token_key(tokens: Sequence[int]) -> str:
    """SHA-256 of the same bytes: the names of format 1 files, still read."""
    return hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest()


def sort_key(tokens) -> bytes:
    """Bytes whose order is the lexicographic order of token sequences (fixed-width big-endian)."""
    return np.asarray(tokens, dtype=np.int64).astype(">u8").tobytes()


class SortedSequences:
    """Token sequences kept in lexicographic order, for longest-prefix questions.

    The sequence sharing the longest prefix with a query sits next to the
    query's place in that order, so `near(query)` (a few neighbours on each
    side, found by bisection) holds it, however many sequences there are.
    """

    def __init__(self):
        self._items: list[tuple[bytes, object]] = []

    def __len__(self) -> int:
        return len(self._items)

    def add(self, key, tokens) -> None:
        bisect.insort(self._items, (sort_key(tokens), key))

    def remove(self, key, tokens) -> None:
        item = (sort_key(tokens), key)
        i = bisect.bisect_left(self._items, item)
        if i < len(self._items) and self._items[i] == item:
            del self._items[i]

    def near(self, tokens, width: int = 4) -> list:
        """Keys of up to `width` sequences on each side of where `tokens` would sort."""
        i = bisect.bisect_left(self._items, (sort_key(tokens),))
        return [k for _, k in self._items[max(0, i - width) : i + width]]

    def before(self, tokens) -> object | None:
        """The key of the last sequence sorting at or before `tokens` (a prefix of it does)."""
        i = bisect.bisect_right(self._items, (sort_key(tokens), _TOP))
        return self._items[i - 1][1] if i else None


class _Top:
    def __lt__(self, other):
        return False

    def __gt__(self, other):
        return True


_TOP = _Top()


def branch_points(sequences, min_len: int = 1) -> list[tuple]:
    """The prefixes at which token sequences branch, shortest first.

    Each is the longest common prefix of two neighbours in sorted order (a
    sequence repeated, or a prefix of another, is one too): together they are
    the branching nodes of the sequences' trie. Shorter than `min_len`: left out.
    """
    ordered = sorted(tuple(s) for s in sequences)
    points = set()
    for a, b in zip(ordered, ordered[1:]):
        n = common_prefix_len(as_token_array(a), as_token_array(b))
        if n >= max(1, min_len):
            points.add(a[:n])
    return sorted(points, key=len)


def parting_points(sequences: list) -> list[int]:
    """For each token sequence, how many leading tokens it shares with the one most like it (0 when it
    is alone): where it starts to say something of its own. Neighbours in sorted order share the most."""
    order = sorted(range(len(sequences)), key=lambda i: sort_key(sequences[i]))
    out = [0] * len(sequences)
    for a, b in zip(order, order[1:]):
        n = common_prefix_len(as_token_array(sequences[a]), as_token_array(sequences[b]))
        out[a], out[b] = max(out[a], n), max(out[b], n)
    return out
