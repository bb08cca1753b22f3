"""The one cache generation sees: the RAM tier over the SSD tier.

- take(): the RAM tier's best prefix, unless the SSD index (no I/O) has a
  strictly longer usable one; that file is restored, verified and published
  in RAM at once (sharing a background read of it: loading.py). Failing both,
  a longer prefix in the remote tier (remote_link.py), if fetching it beats
  prefilling, is fetched, verified, published in RAM and written through to SSD.
- Background reads (prefetch after a model loads, named checkpoints,
  sessions) run on the reader thread and are adopted in poll() (loading.py).
- put(): publishes in RAM and, with write-behind on, queues persistence.
- Persistence, write states, pins and flush: durability.py (the base class).
- The writer yields while a generation runs (`generating()`), unless RAM
  is over budget and waiting on writes (the rule lives in ssd/writer.py).

This is the one owner of the SSD store and writer: the engine asks this
class, never them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from ..kv.checkpoint import Checkpoint
from ..kv.tokens import as_token_array, common_prefix_len
from .durability import Durability, WriteState
from .gate import GenerationGate
from .loading import MIN_RESTORE_TOKENS, Loading
from .ram import Entry, Loan, usable_length
from .ssd.store import CheckpointStore
from .ssd.writer import CheckpointWriter
from .remote.tier import RemoteMiss
from .remote.link import RemoteLink, remote_stats

ABORT_WAIT_S = 0.05  # a rerun waits this long at most for the write it stops to reach a pause point


class TieredPromptCache(Loading, Durability):
    def __init__(
        self,
        *,
        ram_budget_bytes: int | None,
        ssd_dir: Path | None,
        ssd_budget_bytes: int | None = None,
        write_behind: bool = True,
        idle_demote_s: float | None = None,
        emit: Callable[..., object] | None = None,
        retention=None,
        prefetch_budget_bytes: int | None = None,
    ):
        super().__init__(ram_budget_bytes, emit, write_behind=write_behind, idle_demote_s=idle_demote_s,
                         retention=retention)
        self.pressure = None  # the engine's PressureGuard (memory.py), checked at each lookup
        self.gate = GenerationGate()  # a generation runs: the writer and the reader yield
        self.store: CheckpointStore | None = None
        self.writer: CheckpointWriter | None = None
        self.remote: RemoteLink | None = None  # set by the engine when a remote URL is configured
        if ssd_dir is not None:
            self.store = CheckpointStore(Path(ssd_dir), ssd_budget_bytes=ssd_budget_bytes, on_event=self._store_event,
                                         on_removed=self._file_removed)
            self.writer = CheckpointWriter(self.store, under_pressure=self.under_pressure, gate=self.gate)
        self._init_loading(prefetch_budget_bytes)

    # --- wiring ---

    def register_namespace(self, ns: str, identity: dict, *, check: bool = True) -> None:
        self.identities[ns] = dict(identity)
        if self.store is not None:
            self.store.register_namespace(ns, identity, check=check)

    def _store_event(self, event: dict) -> None:
        event = dict(event)
        self._emit(event.pop("type", "store"), **event)

    def under_pressure(self) -> bool:
        """Over the RAM budget, or the machine's memory is short: writes must not wait."""
        return self.over_budget() or bool(self.pressure and self.pressure.active)

    def generating(self):
        """Context for a running generation: the writer and the reader yield the cores."""
        return self.gate.generating()

    def poll(self, prepare: bool = False) -> None:
        """Durability.poll, then adopt finished background reads; prepare=True also
        allocates the next reads' buffers (between cells: not on a lookup's path, nor
        in a flush at shutdown)."""
        super().poll()
        self._collect_reads(prepare)

    # --- lookup ---

    def take(
        self,
        prompt: Sequence[int],
        ns: str,
        session: str | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        move: bool = False,
    ) -> Loan | None:
        self.poll()
        if self.pressure is not None:
            self.pressure.check("lookup")
        prompt = as_token_array(prompt)  # once: the RAM and SSD lookups both compare arrays
        entry, n_ram = self.best(prompt, ns, session)
        if self.store is not None:
            restored = self._restore_longer(prompt, ns, n_ram, progress, move)
            if restored is not None:
                return restored
        if self.remote is not None:
            fetched = self._fetch_remote(prompt, ns, n_ram)
            if fetched is not None:
                return fetched
        return self._serve(entry, n_ram, prompt, ns, move)

    def _fetch_remote(self, prompt, ns, n_ram) -> Loan | None:
        t0 = time.perf_counter()
        try:
            cp = self.remote.lookup(prompt, ns, n_ram)
        except RemoteMiss as e:
            self._emit("restore_failed", ns=ns, source="remote", reason=str(e))
            return None
        if cp is None:
            return None
        entry = self.adopt(cp, ns)  # dirty: the write-through below stores its blocks locally
        if self.store is not None and self.write_behind:
            self.queue_dirty()
        self._emit("hit", ns=ns, source="remote", tokens=len(cp), prompt_tokens=len(prompt), nbytes=cp.nbytes,
                   seconds=time.perf_counter() - t0)
        loan = self.lend(entry, len(cp), "remote")
        self.enforce_budget()
        return loan

    def _restore_longer(self, prompt, ns, n_ram, progress, move) -> Loan | None:
        prompt_array = as_token_array(prompt)
        for _ in range(3):  # a file found to have lost a block left the index: the next longest one
            handle = self.store.find(prompt, ns, min_len=max(MIN_RESTORE_TOKENS, n_ram + 1))
            if handle is None:
                return None
            handle_tokens = as_token_array(handle.tokens)
            n = min(common_prefix_len(handle_tokens, prompt_array), len(prompt) - 1)
            if n <= n_ram or n < MIN_RESTORE_TOKENS:
                return None
            t0 = time.perf_counter()
            if progress is not None:
                progress("restore", 0, len(handle.tokens))
            cp, job = self.read_now(handle)
            if cp is not None:
                break
            if self.store.contains(handle.tokens, ns):  # still there: a passing failure, prefill this time
                return None
        else:
            return None
        if progress is not None:
            progress("restore", len(handle.tokens), len(handle.tokens))
        if usable_length(cp, as_token_array(cp.tokens), prompt_array) != n:  # untrimmable entry that needs a trim
            self._emit("restore_skipped", ns=ns, tokens=len(cp.tokens), reason="untrimmable")
            if job.then:
                self.adopt_job(job, cp)
            return None
        entry = self.adopt_job(job, cp)
        self.counters["ssd_hits"] += 1
        self.counters["ssd_tokens"] += n
        self._emit(
            "hit", ns=ns, source="ssd", tokens=n, prompt_tokens=len(prompt),
            nbytes=cp.nbytes, seconds=time.perf_counter() - t0,
        )
        loan = self.lend(entry, n, "ssd", move)
        self.enforce_budget()
        return loan

    def publish_remote(self, tokens: Sequence[int], ns: str) -> None:
        """Publish a committed checkpoint now: it was just named (remote_publish=named)."""
        if self.remote is not None and self.store is not None:
            info = self.store.file_info(ns, tokens)
            if info is not None:
                self.remote.published(info, self.store.blocks_root)

    def _may_move(self, entry: Entry, n: int) -> bool:
        if not super()._may_move(entry, n):
            return False
        if entry.write_state != WriteState.PENDING:
            return True
        # Its write is queued or being written. A borrower extending all of it
        # writes a successor that covers it, and one rerunning its prompt
        # replaces its old answer: drop that write (or stop it at its next
        # pause point, a few ms) and take the buffers: no copy of the prefix,
        # so a rerun costs the same whether the last write finished or not.
        key = (entry.ns, entry.tokens)
        if self.writer.cancel(key):
            self.counters["writes_cancelled"] += 1
            entry.write_state = WriteState.DIRTY
            return True
        if not self.writer.abort(key, ABORT_WAIT_S):
            return False  # still writing (a slow disk): lend views
        self.drain_completions()  # committed after all, or given up (dirty); its views are released here
        return True

    def _tail_expendable(self, entry: Entry) -> bool:
        # With SSD on, only a durable entry's tail may leave RAM (a restore away),
        # or one whose write is still queued (dropped by _may_move, the rerun replaces it).
        return (self.store is None or entry.write_state == WriteState.PENDING
                or self.store.has_durable_prefix(entry.tokens, entry.ns))

    def adopt(self, cp: Checkpoint, ns: str) -> Entry:
        """Publish a checkpoint restored from SSD: resident at once, already durable.

        One larger than the whole RAM budget is not published; the returned
        entry is then detached, good for this one borrower only.
        """
        entry = super().put(cp, ns, evict=False) or Entry(ns, cp, as_token_array(cp.tokens))
        entry.restored = True
        durable = self.store is not None and self.store.contains(cp.tokens, ns)
        entry.write_state = WriteState.COMMITTED if durable else WriteState.DIRTY if self.store else WriteState.NONE
        return entry

    def restore_exact(self, tokens: Sequence[int], ns: str) -> tuple[Entry | None, str | None]:
        """The entry of exactly `tokens` and where it came from ("ram"|"ssd"), or (None, None)."""
        tokens = tuple(tokens)
        entry = self.get_exact(tokens, ns)
        if entry is not None or self.store is None:
            return entry, ("ram" if entry is not None else None)
        handle = self.store.find(tokens + (-1,), ns, min_len=len(tokens))  # sentinel: at most `tokens`
        if handle is None or handle.match_len != len(tokens):
            return None, None
        cp, job = self.read_now(handle)
        if cp is None:
            return None, None
        self.counters["ssd_hits"] += 1
        if job.exact is None:
            job.exact = len(tokens)
            cp = cp.prefix(len(tokens)) if len(cp.tokens) > len(tokens) else cp
        return self.adopt_job(job, cp), "ssd"

    # --- views ---

    @property
    def has_ssd(self) -> bool:
        return self.store is not None

    def on_ssd(self, tokens: Sequence[int], ns: str) -> bool:
        return self.store is not None and self.store.contains(tokens, ns)

    def ssd_keys(self) -> set:
        """(namespace, token key) of every committed SSD file."""
        return {(h.namespace, h.key) for h in self.store.entries()} if self.store is not None else set()

    def rows(self) -> list[dict]:
        """Every RAM and SSD entry as plain data (see `Engine.cache_entries`)."""
        files = {(h.namespace, tuple(h.tokens)): h for h in self.store.entries()} if self.store else {}
        rows = []
        for e in self.entries():
            h = files.pop((e.ns, e.tokens), None)
            rows.append({
                "ns": e.ns, "tokens": e.tokens, "tier": "ram" if h is None else "ram+ssd",
                "write_state": e.write_state.value, "ram_bytes": e.nbytes, "kv_bytes": e.checkpoint.kv_bytes,
                "file_bytes": None if h is None else h.file_bytes + h.block_bytes,
                "borrowers": e.borrowers, "sessions": sorted(e.sessions), "last_used": e.last_used_time, "hits": e.hits,
            })
        for (ns, tokens), h in files.items():
            rows.append({
                "ns": ns, "tokens": tokens, "tier": "ssd", "write_state": WriteState.COMMITTED.value,
                "ram_bytes": None, "kv_bytes": h.raw_bytes, "file_bytes": h.file_bytes + h.block_bytes,
                "borrowers": 0, "sessions": [], "last_used": h.last_use, "hits": 0,
            })
        return rows

    def stats(self) -> dict:
        pending_count, pending_bytes = self.writer.pending() if self.writer else (0, 0)
        in_progress = self.writer.in_progress if self.writer else None
        entries = list(self._entries.values())
        dirty = [e for e in entries if e.write_state == WriteState.DIRTY]
        failed = [e for e in entries if e.write_state == WriteState.FAILED]
        out = {
            "ram_used_bytes": self.used_bytes,
            "ram_kv_bytes": self.kv_bytes(),
            "ram_budget_bytes": self.budget_bytes,
            "ram_entries": len(entries),
            "write_behind": self.write_behind,
            "ssd_enabled": self.store is not None,
            "pending_writes": pending_count,
            "pending_write_bytes": pending_bytes,
            "write_in_progress_bytes": in_progress[0] if in_progress else 0,
            "write_in_progress_total": in_progress[1] if in_progress else 0,
            "dirty_entries": len(dirty),
            "dirty_bytes": sum(e.nbytes for e in dirty),
            "failed_entries": len(failed),
            "failed_bytes": sum(e.nbytes for e in failed),
            "write_error": self.write_error,
            **self.counters,
            **self.loading_stats(),
        }
        if self.store is not None:
            out.update({f"ssd_{k}": v for k, v in self.store.stats().items()})
        out.update(remote_stats(self.remote))
        return out

    @property
    def catalog(self):
        """The shared catalogue of the SSD directory (None without an SSD tier)."""
        return self.store.catalog if self.store is not None else None

    def gc_files(self, dry_run: bool = False) -> dict:
        """Quarantined files and stale temp files: removed (or, dry_run, only listed)."""
        return self.store.gc(dry_run) if self.store is not None else {"quarantine_removed": [], "temp_removed": []}

    def verify(self) -> list[dict]:
        """Re-hash every SSD file; bad ones are quarantined and listed."""
        if self.store is None:
            return []
        return [{"path": str(p), "reason": reason} for p, reason in self.store.verify_all()]

    def clear(self, ssd: bool = False) -> int:
        """Empty RAM (and, with ssd=True, the SSD tier but for named files).

        Clearing RAM alone keeps entries whose SSD copy is not committed (a
        failed write, say): clearing frees memory, it does not lose state.
        Returns how many entries were kept for that reason.
        """
        self.cancel_reads()
        if ssd or self.store is None:
            super().clear()
            if ssd and self.store is not None:
                self.store.clear()
            return 0
        kept = 0
        for e in self.entries():
            if self.store.has_durable_prefix(e.tokens, e.ns):
                self.remove(e, reason="cleared")
            else:
                kept += 1
        return kept

    def close(self) -> None:
        self.close_reader()
        if self.writer is not None:
            self.writer.close()
            self.store.close()
        if self.remote is not None:
            self.remote.tier.close()

