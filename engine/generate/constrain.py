"""A row's constraint: one more processor in the token loop (loop.py).

Its state is the grammar matcher over the tokens the row emitted (never the prompt's: a template's
forced opening, a thinking block or a tool-call opener, is prompt, and the answer starts after it).
Before sampling, each position's logits are masked to the tokens the grammar allows there (the
positions after drafts: the drafts consumed, then rolled back); after the loop keeps tokens, they are
accepted. A draft the grammar forbids ends the row's drafts before the forward (it could never equal
a masked sample). The state is a function of the accepted tokens, so a resumed run rebuilds it by
replaying what it had emitted.

The log-probabilities a row records are of the constrained distribution (the mask applied, then the
log-softmax), as mlx-lm's logits processors feed its logprobs.
"""

from __future__ import annotations

import time
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..errors import ConstraintError
from .grammars import Compiled


class Constraint:
    """One row's grammar state (`compiled.matcher`'s own copy) and what it cost."""

    def __init__(self, compiled: Compiled):
        self.compiled, self.spec = compiled, compiled.spec
        self.matcher = compiled.matcher.deep_copy()
        self.words = (compiled.vocab + 31) // 32
        self.spent_s = 0.0  # seconds the grammar took: masks computed, tokens accepted
        self.forbidden = 0  # draft tokens the grammar refused before a forward
        self.kept: list[int] = []  # the tokens it accepted
        self.rolls_back = True  # False once a rollback failed (lexemes with max_tokens= or stop=): no drafts

    def accept(self, tokens: Sequence[int]) -> None:
        """The row kept these tokens (or a resumed run replays what it had emitted)."""
        start = time.perf_counter()
        for t in tokens:
            if not self.matcher.consume_token(int(t)):
                raise ConstraintError(f"token {t} breaks the {self.spec.kind} constraint: "
                                      f"{self.matcher.get_error().splitlines()[0]}")
            self.kept.append(int(t))
        self.spent_s += time.perf_counter() - start

    def advance(self, token: int) -> None:
        """Consume a draft for now (a draft model's proposal under the grammar); `rollback` forgets it."""
        self.matcher.consume_token(int(token))

    def rollback(self, n: int) -> None:
        """Forget the last n drafts consumed (once masked or proposed); they were never `kept`."""
        if n and not self.matcher.rollback(n):  # llguidance cannot roll back a max_tokens= or stop= lexeme:
            self.rolls_back = False  # the state rebuilt from the tokens it kept, and no drafts from now on
            self.matcher = self.compiled.matcher.deep_copy()
            if self.kept and not self.matcher.consume_tokens(self.kept):
                raise ConstraintError(f"the {self.spec.kind} constraint cannot be rebuilt: {self.matcher.get_error()}")

    def allowed(self, drafts: Sequence[int]) -> list:
        """The drafts up to the first the grammar forbids (none where it cannot roll back)."""
        n = self.matcher.validate_tokens(list(drafts)) if drafts and self.rolls_back else 0
        self.forbidden += len(drafts) > n
        return list(drafts[:n])

    def bitmasks(self, drafts: Sequence[int] = ()) -> np.ndarray:
        """(len(drafts) + 1, words) int32: the allowed tokens' bits now and after each draft (all allowed;
        after an end token nothing is emitted: no mask there)."""
        t = time.perf_counter()
        out = np.full((len(drafts) + 1, self.words), -1, dtype=np.int32)
        consumed = 0
        for i in range(len(drafts) + 1):
            self.matcher.unsafe_compute_mask_ptr(out[i].ctypes.data, out[i].nbytes)
            if i == len(drafts) or drafts[i] in self.compiled.eos:  # (an end token is never consumed: a
                break  # rollback does not count it)
            self.advance(drafts[i])
            consumed += 1
        self.rollback(consumed)  # (a grammar that cannot roll back forwards no drafts: `allowed`)
        self.spent_s += time.perf_counter() - t
        return out

    def mask(self, logits: mx.array, drafts: Sequence[int] = ()) -> mx.array:
        """`logits` (len(drafts) + 1, vocab) with what the grammar forbids at each position set to -inf."""
        bits = np.unpackbits(self.bitmasks(drafts).view(np.uint8), axis=1, bitorder="little")
        vocab = logits.shape[-1]
        if bits.shape[1] < vocab:  # the model's logits are wider than the tokenizer: those ids never allowed
            bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
        return mx.where(mx.array(bits[:, :vocab].astype(np.bool_)), logits, -mx.inf)

    def outcome(self, text: str, finish_reason: str) -> tuple:
        """(the parsed answer or None, None or why it is missing: 'incomplete JSON (max tokens)')."""
        if self.matcher.is_accepting() and finish_reason != "stop":  # (a stop string cut the text the grammar saw)
            return self.spec.parse(text)
        why = {"length": "max tokens", "stop": "stop string"}.get(finish_reason, finish_reason)
        return None, f"incomplete {self.spec.what} ({why})"

    def stats(self, note: str | None) -> dict:
        return {"constraint": self.spec.kind, "constraint_compile_s": round(self.compiled.compile_s, 6),
                "constraint_cached": self.compiled.cached, "constraint_s": round(self.spent_s, 6),
                "constraint_drafts_forbidden": self.forbidden, "constraint_incomplete": note}
