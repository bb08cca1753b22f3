"""The SSD tier's in-memory view of the catalogue, and lookups on it (no I/O).

One `IndexEntry` per catalogued file, kept per namespace in token order, so
that finding the longest usable prefix of a prompt compares only a few files
next to the prompt's place in that order, however many files there are.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ...kv.tokens import SortedSequences, as_token_array, common_prefix_len
from ..catalog.tables import FileRow


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
    block_bytes: int = 0  # bytes of the blocks it references (shared with other manifests)
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
                   r.kv_bytes, r.identity, r.last_used, r.created, r.block_bytes, _arr=as_token_array(r.tokens))


class FileIndex:
    """(namespace, key) -> IndexEntry, with the files of each namespace in token order
    (trimmable ones apart from exact-only ones). Thread-safe."""

    def __init__(self):
        self.lock = threading.RLock()
        self.entries: dict[tuple, IndexEntry] = {}
        self._sorted: dict[tuple, SortedSequences] = {}  # (namespace, trimmable) -> sequences

    def put(self, e: IndexEntry) -> None:
        with self.lock:
            k = (e.namespace, e.key)
            self.forget(k)
            self.entries[k] = e
            self._sorted.setdefault((e.namespace, e.trimmable), SortedSequences()).add(k, e._arr)

    def forget(self, k: tuple) -> IndexEntry | None:
        with self.lock:
            e = self.entries.pop(k, None)
            if e is not None:
                self._sorted[(e.namespace, e.trimmable)].remove(k, e._arr)
            return e

    def load(self, rows: list[FileRow]) -> None:
        with self.lock:
            self.entries.clear()
            self._sorted.clear()
            for r in rows:
                self.put(IndexEntry.from_row(r))

    def find(self, prompt_tokens: Sequence[int], namespace: str, cap: int, min_len: int) -> IndexEntry | None:
        """The file with the longest usable prefix of the prompt (<= cap, >= min_len tokens).

        Trimmable files: the longest shared prefix is next to the prompt's place in
        token order. Exact-only files must be a prefix of the prompt: the longest
        such is found by bisection too (a few steps back at most).
        """
        prompt = as_token_array(prompt_tokens)
        with self.lock:
            trimmable = self._sorted.get((namespace, True))
            candidates = trimmable.near(prompt) if trimmable and cap >= 1 else []
            if any(self.entries[k].min_reusable_offset for k in candidates):
                # a minimum reusable offset can rule out the nearest: look at all of them (rare)
                candidates = [k for k in self.entries if k[0] == namespace and self.entries[k].trimmable]
            candidates += self._prefix_entries(namespace, prompt[:cap])
            best, best_rank = None, None
            for k in candidates:
                e = self.entries[k]
                n = min(common_prefix_len(e._arr, prompt), cap)
                if n < min_len or not e.can_serve(n):
                    continue
                rank = (n, n == len(e), -e.file_bytes, e.last_use)  # longest, no trim, smaller, recent
                if best_rank is None or rank > best_rank:
                    best, best_rank = e, rank
            return None if best is None else replace(best, match_len=best_rank[0], _arr=None)

    def _prefix_entries(self, namespace: str, query: np.ndarray) -> list:
        """Exact-only files that are a prefix of `query`: the longest one (and nothing else)."""
        exact = self._sorted.get((namespace, False))
        while exact and len(query):
            k = exact.before(query)
            if k is None:
                return []
            e = self.entries[k]
            shared = common_prefix_len(e._arr, query)
            if shared == len(e):  # a prefix of the query
                return [k]
            query = query[:shared]  # any prefix of the query this one passed is a prefix of query[:shared]
        return []

    def covers(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether a longer trimmable file can serve exactly `tokens` (it starts with them)."""
        arr, n = as_token_array(tokens), len(tokens)
        with self.lock:
            trimmable = self._sorted.get((namespace, True))
            for k in trimmable.near(arr) if trimmable else ():
                e = self.entries[k]
                if len(e) > n and e.can_serve(n) and common_prefix_len(e._arr, arr) >= n:
                    return True
        return False

    def snapshot(self) -> list[IndexEntry]:
        with self.lock:
            return [replace(e, _arr=None) for e in self.entries.values()]
