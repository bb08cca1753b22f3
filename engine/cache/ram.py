"""The RAM tier: checkpoints keyed by exact token prefix, per namespace.

take() finds the entry with the longest usable common prefix and lends
zero-copy views of it (the donor stays); put() publishes a finished
checkpoint, replacing exact duplicates, superseding strict prefix ancestors
when the new entry can serve them, and evicting under a byte budget in the
retention policy's order (retention.py). Whether an entry may leave RAM, be
superseded or hand its buffers over is asked of its `ResidencyRules` (entry.py): RAM
alone (`RamOnly`), or the durability part of the tiered cache, which
persists before it demotes (durability.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..kv.checkpoint import Checkpoint
from ..kv.tokens import as_token_array, common_prefix_len
from ..metrics import fmt_bytes
from .entry import Entry, Loan, RamOnly, ResidencyRules, usable_length
from .in_place import lend_in_place
from .retention import LRU, RetentionPolicy


RAM_COUNTERS = ("hits", "misses", "evictions", "supersessions", "oversized", "handovers", "handovers_lent")


class RamTier:
    def __init__(self, budget_bytes: int | None, emit: Callable[..., object] | None = None,
                 retention: RetentionPolicy | None = None, rules: ResidencyRules | None = None,
                 counters: dict | None = None):
        """counters: the dict the tiered cache's parts share (stats); this tier adds its own keys."""
        self.budget_bytes = budget_bytes
        self.retention = retention or LRU()
        self.rules = rules or RamOnly()
        self._emit = emit or (lambda *a, **k: None)
        self._entries: dict[tuple, Entry] = {}  # (ns, tokens) -> entry
        self._sessions: dict[tuple, Entry] = {}  # (ns, session) -> latest entry
        self._held: dict[int, list] = {}  # id(buffer) -> [buffer, entries holding it]: shared buffers count once
        self.on_left: Callable[[Entry, str], None] = lambda entry, reason: None  # evicted, let go or removed
        # the bytes the memory guard lets entries hold now (host/memory.py `room`), None where it does not say
        self.memory_room: Callable[[], int | None] = lambda: None
        self.used_bytes = 0
        self.counters = counters if counters is not None else {}
        self.counters.update(dict.fromkeys(RAM_COUNTERS, 0))

    # --- lookup ---

    def entries(self, ns: str | None = None) -> list[Entry]:
        return [e for e in self._entries.values() if ns is None or e.ns == ns]

    def get_exact(self, tokens: Sequence[int], ns: str) -> Entry | None:
        return self._entries.get((ns, tuple(tokens)))

    def best(self, prompt: Sequence[int], ns: str, session: str | None = None) -> tuple[Entry | None, int]:
        """The entry with the longest usable prefix and that length, no side effects."""
        prompt_array = as_token_array(prompt)
        if session is not None:  # the session's latest checkpoint, when it still fits, skips the scan
            e = self._sessions.get((ns, session))
            if e is not None and len(e.tokens) <= len(prompt) - 1:
                n = usable_length(e.checkpoint, e.token_array, prompt_array)
                if n == len(e.tokens):
                    return e, n
        best, best_n = None, 0
        for e in self._entries.values():
            if e.ns != ns:
                continue
            n = usable_length(e.checkpoint, e.token_array, prompt_array)
            # Prefer the longer match, then an entry that needs no trim, then the most recent.
            better = (n, n == len(e.tokens), e.last_used) > (
                best_n,
                best is not None and best_n == len(best.tokens),
                best.last_used if best else -1,
            )
            if n > 0 and better:
                best, best_n = e, n
        return best, best_n

    def take(self, prompt: Sequence[int], ns: str, session: str | None = None, move: bool = False) -> Loan | None:
        entry, n = self.best(prompt, ns, session)
        return self.serve(entry, n, prompt, ns, move)

    def serve(self, entry: Entry | None, n: int, prompt: Sequence[int], ns: str, move: bool) -> Loan | None:
        """Count a RAM hit or a miss; lend on a hit."""
        if entry is None:
            self.counters["misses"] += 1
            self._emit("miss", ns=ns, prompt_tokens=len(prompt))
            return None
        self.counters["hits"] += 1
        self._emit("hit", ns=ns, source="ram", tokens=n, prompt_tokens=len(prompt))
        return self.lend(entry, n, "ram", move)

    def lend(self, entry: Entry, n: int, source: str, move: bool = False) -> Loan:
        """Views for the borrower; with move=True, the entry's own buffers when it may give them up.

        A moved entry leaves the cache (the borrower's generation publishes
        its successor), so its first decode step appends in place instead of
        copying the whole prefix into a new buffer; one that stays may lend
        them in place for the generation (in_place.py).
        """
        entry.touch()
        entry.hits += 1
        self.retention.hit(entry)
        if move and self._may_move(entry, n):
            caches = entry.checkpoint.hand_over(n, in_place=self._exclusive(entry))
            self._remove(entry)
            self.counters["handovers"] += 1
            self._emit("handover", ns=entry.ns, tokens=len(entry.tokens), used=n)
            stub = Entry(entry.ns, Checkpoint(entry.tokens, (), 0), entry.token_array, sessions=set(entry.sessions))
            return Loan(stub, n, source, self._return, caches=caches)
        loan = lend_in_place(self, entry, n, source) if move else None
        if loan is not None:
            self.counters["handovers_lent"] += 1
            return loan
        entry.borrowers += 1
        return Loan(entry, n, source, self._return)

    def _may_move(self, entry: Entry, n: int) -> bool:
        """Whether an entry hands its buffers to this borrower (nobody else holds them, and its rules agree).

        Yes when the borrower extends all of it: its final checkpoint then
        supersedes the entry. Also when it reuses the entry's whole prompt (a
        rerun of the same cell: the tail is the old generated text, which the
        rerun replaces) and losing that tail from RAM costs little
        (`rules.tail_expendable`). Never for a shared prefix alone (several
        questions about one document): the other question's state stays.
        An entry just read back from SSD (`restored`) hands over to any
        borrower: it is durable, so losing it from RAM costs a restore at most.
        """
        if not entry.checkpoint.can_hand_over or entry.borrowers or entry.pinned:
            return False
        if n != len(entry.tokens):
            reruns_prompt = entry.prompt_tokens is not None and n >= entry.prompt_tokens - 1
            if not ((reruns_prompt or entry.restored) and self.rules.tail_expendable(entry)):
                return False
        return self.rules.may_move(entry, n)

    def _exclusive(self, entry: Entry) -> bool:
        """Whether no other entry shares this one's buffers (a borrower taking its place may
        then append into them in place; MLX would copy a shared one)."""
        return all(self._held.get(id(b), (b, 0))[1] <= 1 for b in entry.checkpoint.buffers())

    def _return(self, entry: Entry) -> None:
        entry.borrowers = max(0, entry.borrowers - 1)

    # --- publication ---

    def put(
        self,
        checkpoint: Checkpoint,
        ns: str,
        *,
        session: str | None = None,
        evict: bool = True,
        prompt_tokens: int | None = None,
    ) -> Entry | None:
        """Publish a finished checkpoint. Returns its entry, or None if not kept.

        prompt_tokens: for a generation's final state, how many of its tokens
        were the prompt (the rest is generated text).
        """
        key = (ns, checkpoint.tokens)
        entry = Entry(ns, checkpoint, as_token_array(checkpoint.tokens), prompt_tokens=prompt_tokens)
        old = self._entries.get(key)
        if old is not None:  # exact duplicate: replaced, keeping its references
            entry.pinned, entry.sessions = old.pinned, old.sessions
            self._remove(old)
        if self._oversized(entry) and self.rules.may_drop(entry, "oversized"):
            self.counters["oversized"] += 1
            self._emit("evict", ns=ns, tokens=len(entry.tokens), nbytes=entry.nbytes, reason="oversized")
            self.on_left(entry, "oversized")
            return None
        self._supersede_ancestors(entry)
        self._insert(entry)
        if session is not None:
            self.bind_session(session, entry)
        if evict:
            self.enforce_budget()
        return entry if self._entries.get(key) is entry else None

    def _supersede_ancestors(self, entry: Entry) -> None:
        cp = entry.checkpoint
        if not cp.trimmable:  # an untrimmable entry serves exact matches only
            return
        for e in list(self._entries.values()):
            if (
                e.ns == entry.ns
                and len(e.tokens) < len(cp.tokens)
                and not e.pinned
                and cp.can_serve(len(e.tokens))
                and common_prefix_len(e.token_array, entry.token_array) == len(e.tokens)
                and self.rules.may_supersede(e, entry)
            ):
                entry.sessions |= e.sessions
                self._remove(e)
                self.counters["supersessions"] += 1
                self._emit("supersede", ns=e.ns, tokens=len(e.tokens), by_tokens=len(cp.tokens), nbytes=e.nbytes)

    def _insert(self, entry: Entry) -> None:
        self._entries[(entry.ns, entry.tokens)] = entry
        self.used_bytes += self._hold(entry, 1)
        self.retention.inserted(entry)
        for s in entry.sessions:
            self._sessions[(entry.ns, s)] = entry

    def _remove(self, entry: Entry) -> None:
        if self._entries.get((entry.ns, entry.tokens)) is entry:
            del self._entries[(entry.ns, entry.tokens)]
            self.used_bytes -= self._hold(entry, -1)
            self.retention.removed(entry)
        for s in entry.sessions:
            if self._sessions.get((entry.ns, s)) is entry:
                del self._sessions[(entry.ns, s)]

    def _hold(self, entry: Entry, step: int) -> int:
        """Count an entry's buffers in (step 1) or out (-1); the bytes that came or went.

        A buffer several entries share (a document under several questions)
        comes with the first and goes with the last; what the checkpoint holds
        outside its layers' buffers (attachments) is its own.
        """
        cp = entry.checkpoint
        buffers = cp.buffers()
        changed = cp.nbytes - sum(b.nbytes for b in buffers)
        for b in buffers:
            rec = self._held.setdefault(id(b), [b, 0])
            rec[1] += step
            if rec[1] == 0:
                del self._held[id(b)]
            if rec[1] == (1 if step > 0 else 0):
                changed += b.nbytes
        return changed

    def own_bytes(self, entry: Entry) -> int:
        """Bytes only this entry holds (what removing it frees); the rest of `nbytes` it shares."""
        cp = entry.checkpoint
        buffers = cp.buffers()
        return cp.nbytes - sum(b.nbytes for b in buffers if self._held.get(id(b), (b, 1))[1] > 1)

    def added_bytes(self, cp: Checkpoint) -> int:
        """Bytes publishing `cp` would add: its buffers no entry holds yet, and its attachments."""
        buffers = cp.buffers()
        return cp.nbytes - sum(b.nbytes for b in buffers if id(b) in self._held)

    def kv_bytes(self) -> int:
        """Bytes of KV the entries hold, shared segments counted once (the longest use of each
        buffer); `used_bytes` is the memory that takes."""
        longest, own = {}, 0
        for e in self._entries.values():
            uses = e.checkpoint.segment_uses()
            for b, n in uses:
                longest[id(b)] = max(longest.get(id(b), 0), n)
            own += e.checkpoint.kv_bytes - sum(n for _, n in uses)
        return sum(longest.values()) + own

    def remove(self, entry: Entry, reason: str = "removed") -> None:
        self._remove(entry)
        self.on_left(entry, reason)
        self._emit("remove", ns=entry.ns, tokens=len(entry.tokens), nbytes=entry.nbytes, reason=reason)

    def readmit(self, entry: Entry) -> bool:
        """Back from a loan in place (in_place.py), unless its key was taken; sessions rebound stay."""
        if (entry.ns, entry.tokens) in self._entries:
            return False
        entry.sessions = {s for s in entry.sessions if (entry.ns, s) not in self._sessions}
        self._insert(entry)
        return True

    def forget(self, entry: Entry) -> None:
        """Leave RAM without an event (the caller reported why: an idle demotion, a hand-over)."""
        self._remove(entry)

    # --- sessions ---

    def bind_session(self, session: str, entry: Entry) -> None:
        old = self._sessions.get((entry.ns, session))
        if old is not None and old is not entry:
            old.sessions.discard(session)
        entry.sessions.add(session)
        self._sessions[(entry.ns, session)] = entry

    def session_entry(self, session: str, ns: str) -> Entry | None:
        return self._sessions.get((ns, session))

    def drop_session(self, session: str) -> None:
        for key in [k for k in self._sessions if k[1] == session]:
            self._sessions.pop(key).sessions.discard(session)

    # --- budget ---

    def victims(self) -> list[Entry]:
        """Eviction order: oversized first, unreferenced before session-referenced, then the
        retention policy (LRU by default); pinned last."""
        return sorted(
            self._entries.values(),
            key=lambda e: (bool(e.pinned), not self._oversized(e), bool(e.sessions), self.retention.key(e)),
        )

    def cap(self) -> tuple[int, str] | None:
        """The most one entry may hold and what sets it: (bytes, "budget"), or (bytes, "memory") where the
        memory guard leaves the entries less than the budget (None: neither bounds it)."""
        room = self.memory_room()
        if room is not None and (self.budget_bytes is None or room < self.budget_bytes):
            return max(0, room), "memory"
        return None if self.budget_bytes is None else (self.budget_bytes, "budget")

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` may stay in RAM (`cap`)."""
        cap = self.cap()
        return cap is None or nbytes <= cap[0]

    def too_large(self, nbytes: int, ssd: bool) -> str | None:
        """Why a checkpoint of `nbytes` is not kept in RAM, in words (None: it may be); ssd: an SSD tier keeps it."""
        cap = self.cap()
        if cap is None or nbytes <= cap[0]:
            return None
        limit = "the RAM budget" if cap[1] == "budget" else "the room memory leaves the cache now"
        return (f"this checkpoint ({fmt_bytes(nbytes)}) is larger than {limit} ({fmt_bytes(cap[0])}): "
                + ("kept on SSD only, each use restores it" if ssd else "not kept, each use prefills it"))

    def _oversized(self, entry: Entry) -> bool:
        return not self.fits(entry.nbytes)

    def held_bytes(self) -> int:
        """RAM entries and what the rules count beside them (checkpoints waiting for the disk)."""
        return self.used_bytes + self.rules.extra_bytes()

    def over_budget(self) -> bool:
        """RAM entries, and what the rules count beside them, against the budget."""
        return self.budget_bytes is not None and self.held_bytes() > self.budget_bytes

    def enforce_budget(self) -> None:
        """Let oversized entries go once they may, then evict in `victims()` order while over budget.
        A victim that may not leave yet (its SSD write is pending) stops eviction: the budget is
        soft until it can go, and no hotter entry is evicted in its place."""
        freed = False
        for victim in [e for e in self._entries.values() if self._oversized(e)]:  # (a budget or no room)
            if self.rules.may_drop(victim, "oversized"):
                self._evict(victim, "oversized")
                freed = True
        for victim in self.victims() if self.over_budget() else ():
            if not self.over_budget():
                break
            if not self.rules.may_drop(victim, "budget"):
                if victim.pinned:
                    continue  # pinned entries come last; one that must stay blocks nothing
                break
            self._evict(victim, "budget")
            freed = True
        if freed:
            self.rules.freed()

    def reclaim(self, nbytes: int, reason: str = "pressure") -> int:
        """Let entries go, least valuable first, until `nbytes` are freed (memory pressure).

        Unlike the byte budget this goes past an entry that must stay (its write
        is queued instead): the machine needs memory now. Returns the bytes freed:
        what RAM entries no longer hold (an entry sharing its buffers with one that
        stays frees only what is its own).
        """
        before = self.used_bytes
        for e in self.victims():
            if before - self.used_bytes >= nbytes:
                break
            if not e.borrowers and self.rules.may_drop(e, reason):
                self._evict(e, reason)
        freed = before - self.used_bytes
        if freed:
            self.rules.freed()
        return freed

    def _evict(self, entry: Entry, reason: str) -> None:
        self.retention.evicted(entry)
        self._remove(entry)
        self.counters["oversized" if reason == "oversized" else "evictions"] += 1
        self._emit("evict", ns=entry.ns, tokens=len(entry.tokens), nbytes=entry.nbytes, reason=reason)
        self.on_left(entry, reason)

    def clear(self) -> None:
        for e in list(self._entries.values()):
            self._remove(e)
            self.on_left(e, "cleared")
        self._sessions.clear()
