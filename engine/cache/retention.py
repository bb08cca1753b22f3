"""Which RAM entry leaves first: retention policies for the RAM tier.

A policy (`RetentionPolicy`) gives each entry a sort key (lowest leaves
first) and hears about insertions, hits, evictions and removals; what it
remembers about an entry it keeps itself (never on the entry). The RAM tier applies it within its fixed
order (oversized first, entries no chat session references before those a
session does, pinned last) and stops at the first victim that may not leave
yet. The default was chosen by replaying recorded notebook traces
(benchmarks/bench_retention.py, docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Protocol


class RetentionPolicy(Protocol):
    name: str

    def key(self, entry) -> float:
        """Sort key: the lowest leaves RAM first."""

    def inserted(self, entry) -> None:
        """An entry was published."""

    def hit(self, entry) -> None:
        """An entry was lent to a borrower."""

    def evicted(self, entry) -> None:
        """An entry is about to leave RAM for lack of room (before `removed`)."""

    def removed(self, entry) -> None:
        """An entry left RAM (evicted, superseded, replaced or cleared): forget it."""


class LRU:
    """Least recently used first."""

    name = "lru"

    def key(self, e) -> float:
        return e.last_used

    def inserted(self, e) -> None:
        pass

    def hit(self, e) -> None:
        pass

    def evicted(self, e) -> None:
        pass

    def removed(self, e) -> None:
        pass


def prefill_cost(tokens: int) -> float:
    """Relative cost of prefilling `tokens` from scratch: linear work plus attention's quadratic part."""
    return tokens * (1.0 + tokens / 4096)


class CostAware:
    """Greedy-Dual-Size-Frequency: keep what saves the most prefill per byte held, often reused.

    priority = inflation + uses x prefill_cost(tokens) / bytes; the lowest
    priority leaves first and raises the inflation to its value, so entries
    that stop being used age out.
    """

    name = "cost"

    def __init__(self):
        self.inflation = 0.0
        self.scores: dict[int, float] = {}  # id(entry) -> its priority, while it is in RAM

    def _score(self, e) -> None:
        self.scores[id(e)] = self.inflation + (e.hits + 1) * prefill_cost(len(e.tokens)) / max(e.nbytes, 1)

    def key(self, e) -> float:
        return self.scores.get(id(e), self.inflation)

    def inserted(self, e) -> None:
        self._score(e)

    def hit(self, e) -> None:
        if id(e) in self.scores:  # (an entry lent without being in RAM: nothing to remember)
            self._score(e)

    def evicted(self, e) -> None:
        self.inflation = max(self.inflation, self.key(e))

    def removed(self, e) -> None:
        self.scores.pop(id(e), None)


POLICIES = {"lru": LRU, "cost": CostAware}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown retention policy {name!r}: use one of {', '.join(POLICIES)}") from None
