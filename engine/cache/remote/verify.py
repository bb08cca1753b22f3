"""Trust, then verify, before keeping: states fetched from the team tier stay on probation until
this machine has recomputed them.

A remote hit serves the cell that asked at once. Until the engine has
recomputed that state itself (kv/recompute.py, a few dozen tokens per
`step()`, in idle time between cells) and found it equal within chunk
noise, the state and every state computed over it (a prefix it shares of at
least a block) is *held*: not written to the local SSD (so not restored after
a restart, nor published: link.py never republishes a fetched state anyway),
and a later cell borrowing it from RAM is told its tokens came from the remote,
not RAM. Once equal, the held entries are released to the SSD tier.

A mismatch drops the state and what was computed over it everywhere locally
(RAM, SSD), stops trusting its writer on this machine (its records are misses
from then on, and its earlier entries leave the SSD), writes the evidence
(writer, key, layer, position, the writer's own record signature; signed by
this member's key when it has one) to `remote-evidence/` in the cache
directory, and tells the user which earlier cells used it (`alerts`).
Owner thread.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...host import safe_dirs
from ...kv.recompute import SAMPLED_POSITIONS, Mismatch, Recomputation, describe
from ...kv.tokens import as_token_array, common_prefix_len

EVIDENCE_DIR = "remote-evidence"  # beside the catalogue
HELD_PREFIX = 32  # a state sharing this many leading tokens with a held one may have been computed over it
MAX_PENDING = 8  # states on probation at once; an older one beyond this is dropped unverified
MAX_EVIDENCE_FILE_BYTES = 1 << 20
COUNTERS = ("verified", "verify_tokens", "forged", "verify_dropped", "distrusted", "sampled", "sample_unchecked")
SECONDS = ("verify_seconds", "sample_seconds")
log = logging.getLogger(__name__)


@dataclass(eq=False)
class Probation:
    ns: str
    tokens: tuple
    writer: str  # hex writer id; "" unsigned (no allow-list)
    key_id: str
    work: Recomputation
    record: dict  # what the writer signed: prefix key, signature, signed head (hex)
    uses: list = field(default_factory=list)  # the cells that used it


class Verifier:
    def __init__(self, root: Path | None, *, model_of: Callable, release: Callable[[], None],
                 drop: Callable[[str, Callable[[tuple], bool]], int], distrust: Callable[[], None],
                 name_of: Callable[[str], str], sign: Callable[[bytes], bytes] | None = None,
                 emit: Callable[..., object] = lambda *a, **k: None):
        """model_of(ns): the loaded model that recomputes a namespace's states; release(): queue the writes of entries no longer held; drop(ns, held(tokens)): remove every
        local state `held` says was computed over a bad one; distrust(): sweep what untrusted
        writers left on SSD; name_of(writer hex): its allow-list name; sign: this member's key."""
        self.model_of, self.release, self.drop, self.after_distrust = model_of, release, drop, distrust
        self.name_of, self.sign, self.emit = name_of, sign, emit
        self.sampled_positions = SAMPLED_POSITIONS  # the fetch-time check's k (0: off)
        self.cell: Callable[[], str] = lambda: f"the generation at {time.strftime('%H:%M:%S')}"  # the kernel: In [n]
        self.pending: list[Probation] = []
        self.alerts: list[str] = []  # what the user must be told (the kernel prints them)
        self.counters = zero_counters()
        self.root = None
        self.distrusted: set[str] = set()  # writer ids (hex); "kid:<key id>" for an unsigned team
        if root is not None:
            try:
                self.root = safe_dirs.make_private_dir(root, Path(root).parent)
                for name in safe_dirs.listdir(self.root, self.root.parent):
                    if name.endswith(".json") and not name.startswith("."):
                        self._load(self.root / name)
            except OSError:
                self.root = None

    def _load(self, path: Path) -> None:
        try:
            if path.stat().st_size <= MAX_EVIDENCE_FILE_BYTES:
                d = json.loads(path.read_text())
                self.distrusted.add(_who(d["writer"], d["key_id"]))
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("unreadable remote evidence file %s", path)

    # --- the link asks ---

    def trusts(self, writer: str, key_id: str) -> bool:
        return _who(writer, key_id) not in self.distrusted

    def add(self, ns: str, cp, writer: str, key_id: str, record: dict) -> None:
        """A state just fetched, for the cell running now: on probation."""
        m = self.model_of(ns)
        if m is None:
            return
        work = Recomputation(m, cp)
        while len(self.pending) >= MAX_PENDING:
            self._drop(self.pending.pop(0), "too many states on probation")
        self.pending.append(Probation(ns, tuple(cp.tokens), writer, key_id, work, record, [self.cell()]))

    def holds(self, ns: str, tokens) -> Probation | None:
        """The probation that keeps a state of `tokens` from SSD (computed over a state not yet verified)."""
        return next((p for p in self.pending if p.ns == ns and _over(p, tokens)), None)

    def used(self, ns: str, tokens) -> None:
        p, cell = self.holds(ns, tokens), self.cell()
        if p is not None and cell not in p.uses:
            p.uses.append(cell)

    # --- idle time (owner thread, between cells) ---

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def step(self) -> None:
        """One short step of the oldest probation's recomputation; its verdict once it is finished."""
        if not self.pending:
            return
        p = self.pending[0]
        before = p.work.done
        try:
            p.work.step()
        except Exception as e:  # noqa: BLE001 - a recomputation that cannot run: the state is dropped, unverified
            log.warning("remote state not verifiable", exc_info=True)
            self.pending.remove(p)
            self._drop(p, f"could not be recomputed ({type(e).__name__}: {e})")
            return
        self.counters["remote_verify_tokens"] += p.work.done - before
        if not p.work.finished:
            return
        self.pending.remove(p)
        self.counters["remote_verify_seconds"] += p.work.seconds
        if p.work.mismatch is None:
            self.counters["remote_verified"] += 1
            self.emit("remote_verified", ns=p.ns, tokens=len(p.tokens), seconds=p.work.seconds,
                      max_error=p.work.max_error)
            self.release()
        else:
            self._forged(p, p.work.mismatch)

    def run(self, budget_s: float | None = None) -> int:
        """Step until nothing is on probation (or `budget_s` has passed); how many remain."""
        t_end = None if budget_s is None else time.monotonic() + budget_s
        while self.pending and (t_end is None or time.monotonic() < t_end):
            self.step()
        return len(self.pending)

    # --- verdicts ---

    def forged(self, ns: str, cp, writer: str, key_id: str, record: dict, mismatch: Mismatch) -> None:
        """A state the fetch-time sample found wrong (never served): the same verdict as a recomputation's."""
        self._forged(Probation(ns, tuple(cp.tokens), writer, key_id, None, record, []), mismatch)

    def _forged(self, p: Probation, m: Mismatch) -> None:
        self.counters["remote_forged"] += 1
        dropped = self.drop(p.ns, lambda tokens, p=p: _over(p, tokens))
        who = self.name_of(p.writer) if p.writer else f"an unsigned member (key id {p.key_id})"
        self.distrusted.add(_who(p.writer, p.key_id))
        evidence = {"writer": p.writer, "writer_name": who, "key_id": p.key_id, "namespace": p.ns,
                    "tokens": len(p.tokens), "layer": m.layer, "position": m.position, "error": m.error,
                    "record": p.record, "cells": p.uses, "time": time.time()}
        path = self._record(evidence)
        self.after_distrust()
        cells = ", ".join(p.uses) if p.uses else "no cell (caught before use)"
        msg = (f"mlxcache: the team tier's KV for a {len(p.tokens)}-token prompt, written by {who}, is not what "
               f"this model computes ({describe(m)}). It was dropped here ({dropped} local entries), {who} is no "
               f"longer trusted on this machine, and the evidence is in {path or 'the events'}. "
               f"Cells that used it: {cells}" + ("; rerun them." if p.uses else "."))
        log.warning("%s", msg)
        self.alerts.append(msg)
        self.emit("remote_forged", ns=p.ns, tokens=len(p.tokens), writer=who, layer=m.layer, position=m.position,
                  cells=list(p.uses), evidence=str(path) if path else None)

    def _drop(self, p: Probation, why: str) -> None:
        self.counters["remote_verify_dropped"] += 1
        self.drop(p.ns, lambda tokens, p=p: _over(p, tokens))
        log.info("remote state of %d tokens dropped unverified: %s", len(p.tokens), why)

    def _record(self, evidence: dict) -> Path | None:
        body = json.dumps(evidence, sort_keys=True).encode()
        if self.sign is not None:
            evidence = {**evidence, "reporter_signature": self.sign(body).hex()}
        if self.root is None:
            return None
        path = self.root / f"{int(evidence['time'] * 1000)}-{evidence['writer'][:16] or 'unsigned'}.json"
        safe_dirs.write_json_atomic(path, evidence, root=self.root.parent)
        return path


def _who(writer: str, key_id: str) -> str:
    return writer if writer else f"kid:{key_id}"


def _over(p: Probation, tokens) -> bool:
    """Was a state of `tokens` possibly computed over p's (a prefix of at least a block in common)?"""
    return common_prefix_len(as_token_array(tokens), as_token_array(p.tokens)) >= min(HELD_PREFIX, len(p.tokens))


def zero_counters() -> dict:
    return {**{f"remote_{k}": 0 for k in COUNTERS}, **{f"remote_{k}": 0.0 for k in SECONDS}}


def attach(cache, link, model_of: Callable, root: Path | None, emit: Callable[..., object]) -> Verifier:
    """The verifier of `link` (remote/link.py) over `cache` (a TieredPromptCache): what it holds
    back from the SSD, and what it drops and sweeps on a mismatch."""

    def drop(ns: str, over: Callable) -> int:
        gone = [e for e in cache.ram.entries(ns) if over(e.tokens)]
        for e in gone:
            cache.ram.remove(e, "forged")
        if cache.store is None:
            return len(gone)
        keys = [(e.namespace, e.key) for e in cache.store.entries() if e.namespace == ns and over(e.tokens)]
        try:
            return len(gone) + (cache.store.remove(keys, "forged") if keys else 0)
        except Exception:  # noqa: BLE001 - a busy catalogue: the origins sweep at the next start removes them
            log.warning("forged remote state: SSD entries not removed now", exc_info=True)
            return len(gone)

    def distrust() -> None:
        store = cache.store
        link.origins.sweep(link.trusted, None if store is None else lambda keys: store.remove(keys, "revoked"))

    signer = link.tier.signer
    v = Verifier(root, model_of=model_of, release=cache.durability.queue_dirty, drop=drop, distrust=distrust,
                 name_of=lambda w: link.tier.writers.name(bytes.fromhex(w)), emit=emit,
                 sign=None if signer is None else signer.sign)
    cache.durability.held = lambda ns, tokens: v.holds(ns, tokens) is not None
    return v
