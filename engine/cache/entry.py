"""A RAM entry (a published checkpoint and what the tiers know about it) and a borrower's loan of one."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

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
