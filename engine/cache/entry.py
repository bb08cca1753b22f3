"""A RAM entry (a published checkpoint and what the tiers know about it), a borrower's loan of one, and
the rules the RAM tier asks before an entry leaves RAM or changes hands (`ResidencyRules`)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from ..kv.checkpoint import Checkpoint
from ..kv.tokens import common_prefix_len


def usable_length(checkpoint: Checkpoint, token_array: np.ndarray, prompt: np.ndarray) -> int:
    """How many prompt tokens this checkpoint can serve (0 if none).

    Capped at len(prompt) - 1 so at least one token is forwarded to get
    logits; a shorter match on a longer entry needs a trimmable entry.
    """
    n = min(common_prefix_len(token_array, prompt), len(prompt) - 1)
    return n if n > 0 and checkpoint.can_serve(n) else 0


_clock = itertools.count(1)


@dataclass(eq=False)
class Entry:
    ns: str
    checkpoint: Checkpoint
    token_array: np.ndarray
    last_used: int = field(default_factory=lambda: next(_clock))
    last_used_time: float = field(default_factory=time.time)
    borrowers: int = 0
    pinned: set = field(default_factory=set)  # names of checkpoints that pin it
    sessions: set = field(default_factory=set)
    write_state: Any = None  # set and read by the tier above (tiered.WriteState); the RAM tier ignores it
    write_error: str | None = None
    hits: int = 0
    prompt_tokens: int | None = None  # a generation's final state: how much of it was the prompt
    restored: bool = False  # read back from SSD (durable; where its prompt ended is not known)
    blocks: tuple = ()  # (name, start, end) of the SSD blocks it was read from: restores of the same blocks share it

    @property
    def tokens(self) -> tuple:
        return self.checkpoint.tokens

    @property
    def nbytes(self) -> int:
        return self.checkpoint.nbytes

    def touch(self) -> None:
        self.last_used = next(_clock)
        self.last_used_time = time.time()


class Loan:
    """A borrower's share of an entry: fresh cache objects over views."""

    def __init__(
        self, entry: Entry, length: int, source: str, release: Callable[[Entry], None], caches: list | None = None
    ):
        self.entry = entry
        self.length = length
        self.source = source  # "ram" | "ssd"
        self.caches = entry.checkpoint.lend(length) if caches is None else caches
        self._release = release

    def release(self) -> None:
        if self._release is not None:
            self._release(self.entry)
            self._release = None
            self.caches = None


class ResidencyRules(Protocol):
    """What the RAM tier asks the tier below it before an entry leaves RAM or changes hands."""

    def may_drop(self, entry: Entry, reason: str) -> bool:
        """Whether `entry` may leave RAM now ("budget", "oversized", "pressure", "idle"...): with an SSD
        tier only once a committed file covers it (otherwise a write is queued and it stays)."""

    def may_supersede(self, ancestor: Entry, by: Entry) -> bool:
        """Whether a longer checkpoint that serves `ancestor` may replace it."""

    def may_move(self, entry: Entry, n: int) -> bool:
        """Whether `entry`'s buffers may go to a borrower of its first n tokens (the RAM tier has
        already checked that nobody else holds them)."""

    def tail_expendable(self, entry: Entry) -> bool:
        """Whether the positions past a rerun's prompt may leave RAM with a hand-over."""

    def may_step_aside(self, entry: Entry) -> bool:
        """Whether `entry` may leave RAM during a loan in place (in_place.py): nothing holds its arrays."""

    def extra_bytes(self) -> int:
        """Bytes held outside RAM entries that count against the budget (checkpoints waiting for the disk)."""

    def freed(self) -> None:
        """Entries left RAM: give their memory back."""


class RamOnly:
    """The rules without a tier below: only a name keeps an entry in RAM."""

    def may_drop(self, entry: Entry, reason: str) -> bool:
        return not entry.pinned

    def tail_expendable(self, entry: Entry, *_) -> bool:
        return True  # (the tail is a cached old answer, nothing else has it either way)

    may_supersede = may_move = may_step_aside = tail_expendable  # nothing below to ask

    def extra_bytes(self) -> int:
        return 0

    def freed(self) -> None:
        pass
