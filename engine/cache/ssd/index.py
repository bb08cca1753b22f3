"""The SSD tier's in-memory view of the catalogue, and lookups on it (no I/O).

One `IndexEntry` per catalogued file, grouped per namespace in a
`PrefixIndex`, so that finding the longest usable prefix of a prompt compares
only the files that share a prefix with it, however many files there are.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ...kv.tokens import PrefixIndex, as_token_array, common_prefix_len
from ..catalog import FileRow


@dataclass(eq=False)
class IndexEntry:
    namespace: str
    key: str
    path: Path
    tokens: tuple
    trimmable: bool
    min_reusable_offset: int
    file_bytes: int
    raw_bytes: int
    identity: dict
    last_use: float
    created: float = 0.0
    match_len: int | None = None  # set on copies returned by find()
    _arr: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def can_serve(self, n: int) -> bool:
        if n < 1 or n > len(self.tokens) or n < self.min_reusable_offset:
            return False
        return n == len(self.tokens) or self.trimmable

    @classmethod
    def from_row(cls, r: FileRow) -> "IndexEntry":
        return cls(r.namespace, r.key, Path(r.path), r.tokens, r.trimmable, r.min_reusable_offset, r.file_bytes,
                   r.kv_bytes, r.identity, r.last_used, r.created, _arr=as_token_array(r.tokens))


class FileIndex:
    """(namespace, key) -> IndexEntry, with a prefix index per namespace. Thread-safe."""

    def __init__(self):
        self.lock = threading.RLock()
        self.entries: dict[tuple, IndexEntry] = {}
        self._prefixes: dict[str, PrefixIndex] = {}

    def put(self, e: IndexEntry) -> None:
        with self.lock:
            k = (e.namespace, e.key)
            self.forget(k)
            self.entries[k] = e
            self._prefixes.setdefault(e.namespace, PrefixIndex()).add(k, e._arr)

    def forget(self, k: tuple) -> IndexEntry | None:
        with self.lock:
            e = self.entries.pop(k, None)
            if e is not None:
                self._prefixes[e.namespace].remove(k, e._arr)
            return e

    def load(self, rows: list[FileRow]) -> None:
        with self.lock:
            self.entries.clear()
            self._prefixes.clear()
            for r in rows:
                self.put(IndexEntry.from_row(r))

    def find(self, prompt_tokens: Sequence[int], namespace: str, cap: int, min_len: int) -> IndexEntry | None:
        """The file with the longest usable prefix of the prompt (<= cap, >= min_len tokens)."""
        prompt = as_token_array(prompt_tokens)
        with self.lock:
            prefixes = self._prefixes.get(namespace)
            for group in prefixes.candidates(prompt, min_len) if prefixes and cap >= 1 else ():
                best, best_rank = None, None  # deepest shared prefix first
                for k in group:
                    e = self.entries[k]
                    n = min(common_prefix_len(e._arr, prompt), cap)
                    if not e.can_serve(n):
                        continue
                    rank = (n, n == len(e), -e.file_bytes, e.last_use)  # longest, no trim, smaller, recent
                    if best_rank is None or rank > best_rank:
                        best, best_rank = e, rank
                if best is not None and best_rank[0] >= min_len:
                    return replace(best, match_len=best_rank[0], _arr=None)
        return None

    def covers(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether a longer file can serve exactly `tokens` (trimmable and sharing them)."""
        arr, n = as_token_array(tokens), len(tokens)
        with self.lock:
            prefixes = self._prefixes.get(namespace)
            for group in prefixes.candidates(arr, n) if prefixes else ():
                if any(len(self.entries[k]) > n and self.entries[k].can_serve(n)
                       and common_prefix_len(self.entries[k]._arr, arr) >= n for k in group):
                    return True
        return False

    def snapshot(self) -> list[IndexEntry]:
        with self.lock:
            return [replace(e, _arr=None) for e in self.entries.values()]
