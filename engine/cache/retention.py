"""Which RAM entry leaves first: retention policies for the RAM tier.

A policy gives each entry a sort key (lowest leaves first) and hears about
insertions, hits and evictions. The RAM tier applies it within its fixed
order (oversized first, entries no chat session references before those a
session does, pinned last) and stops at the first victim that may not leave
yet. The default was chosen by replaying recorded notebook traces
(benchmarks/bench_retention.py, docs/benchmarks.md).
"""

from __future__ import annotations


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

    def _score(self, e) -> None:
        e.score = self.inflation + (e.hits + 1) * prefill_cost(len(e.tokens)) / max(e.nbytes, 1)

    def key(self, e) -> float:
        return e.score

    def inserted(self, e) -> None:
        self._score(e)

    def hit(self, e) -> None:
        self._score(e)

    def evicted(self, e) -> None:
        self.inflation = max(self.inflation, e.score)


POLICIES = {"lru": LRU, "cost": CostAware}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown retention policy {name!r}: use one of {', '.join(POLICIES)}") from None
