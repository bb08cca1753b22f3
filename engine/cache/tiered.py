"""The one cache generation sees: the RAM tier over the SSD tier (over the remote tier).

It holds its parts, each behind a short contract:

- `ram` (ram.py): entries by exact token prefix, lending, supersession, the byte
  budget; it asks its `ResidencyRules` before an entry leaves or moves.
- `retention` (retention.py): which RAM entry leaves first; keeps its own state.
- `durability` (durability.py): write states, persist-before-demotion, retries,
  flush, pins, in-flight checkpoints; it is the RAM tier's rules.
- `loading` (loading.py): reads back into RAM, at once or in the background.
- `store` and `writer` (ssd/): the files and the background writer; `remote`
  (remote/link.py): the shared tier, attached by the engine.

What it does itself: the lookup across tiers and publication.

- take(): the RAM tier's best prefix, unless the SSD index (no I/O) has a
  strictly longer usable one; that file is restored, verified and published
  in RAM at once (sharing a background read of it). Failing both, a longer
  prefix in the remote tier, if fetching it beats prefilling, is fetched,
  verified, published in RAM and written through to SSD.
- put(): publishes in RAM and, with write-behind on, queues persistence.
- The writer and the reader yield while a generation runs (`generating()`),
  unless RAM is over budget and waiting on writes (ssd/writer.py).

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
from .entry import Entry, Loan, usable_length
from .ram import RamTier
from .remote.link import RemoteLink, remote_stats
from .remote.tier import RemoteMiss
from .retention import RetentionPolicy
from .why import Cached, Departures, cached_prefixes, left_ram
from .ssd.store import CheckpointStore
from .ssd.writer import CheckpointWriter


class TieredPromptCache:
    def __init__(self, *, ram_budget_bytes: int | None, ssd_dir: Path | None, ssd_budget_bytes: int | None = None,
                 write_behind: bool = True, idle_demote_s: float | None = None,
                 emit: Callable[..., object] | None = None, retention: RetentionPolicy | None = None,
                 prefetch_budget_bytes: int | None = None, ssd_filesystems: tuple = ()):
        self.emit = emit or (lambda *a, **k: None)
        self.counters: dict = {}  # every part's counters, for stats
        self.pressure = None  # the engine's PressureGuard (host/memory.py), checked at each lookup
        self.gate = GenerationGate()  # a generation runs: the writer and the reader yield
        self.remote: RemoteLink | None = None  # set by the engine when a remote URL is configured
        self.ram = RamTier(ram_budget_bytes, self.emit, retention, counters=self.counters)
        self.ram.memory_room = lambda: self.pressure.room if self.pressure is not None else None
        self.departures = Departures()  # what left without a copy elsewhere (why.py)
        self.ram.on_left = self._left_ram
        self.store: CheckpointStore | None = None
        self.writer: CheckpointWriter | None = None
        self._removed_early: list = []  # files the store found gone before durability existed
        if ssd_dir is not None:
            self.store = CheckpointStore(Path(ssd_dir), ssd_budget_bytes=ssd_budget_bytes, on_event=self._store_event,
                                         on_removed=self._file_removed, filesystems=ssd_filesystems)
            self.writer = CheckpointWriter(self.store, under_pressure=self.under_pressure, gate=self.gate)
        self.durability = Durability(self.ram, self.store, self.writer, counters=self.counters, emit=self.emit,
                                     write_behind=write_behind, idle_demote_s=idle_demote_s)
        self.ram.rules = self.durability
        for ns, tokens in self._removed_early:
            self.durability.file_removed(ns, tokens)
        self.loading = Loading(self.ram, self.store, gate=self.gate, counters=self.counters, emit=self.emit,
                               adopt=self.adopt, pressure=lambda: self.pressure,
                               prefetch_budget_bytes=prefetch_budget_bytes)

    # --- wiring ---

    @property
    def retention(self) -> RetentionPolicy:
        return self.ram.retention

    @property
    def identities(self) -> dict:
        return self.durability.identities

    def register_namespace(self, ns: str, identity: dict, *, check: bool = True) -> None:
        self.durability.identities[ns] = dict(identity)
        if self.store is not None:
            self.store.register_namespace(ns, identity, check=check)

    def follow_pins(self, named: Callable[[], dict]) -> None:
        """The catalogue's pins follow `named()` (name -> (namespace, tokens) of the named records):
        synced now, and again whenever the catalogue is rebuilt (pins.py)."""
        self.durability.pins.source = named
        self.durability.pins.sync()

    def _left_ram(self, entry: Entry, reason: str) -> None:
        """Remember an entry that left RAM with no SSD copy (why.py): a cause a user can act on."""
        if self.store is None or not self.store.has_durable_prefix(entry.tokens, entry.ns):
            self.departures.left(entry.ns, entry.tokens, *left_ram(entry, reason, self.store is not None))

    def _file_removed(self, ns: str, tokens: tuple) -> None:
        """Another process deleted a file (any thread): entries it covered are dirty again."""
        if self.ram.get_exact(tokens, ns) is None:
            self.departures.left(ns, tokens, "its SSD file was removed (the SSD cap, %cache clear or gc, here or in "
                                             "another kernel)")
        durability = getattr(self, "durability", None)
        (durability.file_removed if durability is not None else lambda *k: self._removed_early.append(k))(ns, tokens)

    def _store_event(self, event: dict) -> None:
        event = dict(event)
        self.emit(event.pop("type", "store"), **event)

    def under_pressure(self) -> bool:
        """Over the RAM budget, or the machine's memory is short: writes must not wait."""
        return self.ram.over_budget() or bool(self.pressure and self.pressure.active)

    def held_bytes(self) -> int | None:
        """What the entries hold, for the memory guard's `room` (None while a generation runs)."""
        return None if self.gate.running else self.ram.held_bytes()

    def generating(self):
        """Context for a running generation: the writer and the reader yield the cores."""
        return self.gate.generating()

    def poll(self, prepare: bool = False) -> None:
        """Apply writer completions and deletions elsewhere, then adopt finished background reads;
        prepare=True also allocates the next reads' buffers (between cells: not on a lookup's
        path, nor in a flush at shutdown)."""
        self.durability.poll()
        self.loading.collect(prepare)
        if prepare and self.remote is not None and self.remote.verifier is not None:
            self.remote.verifier.step()  # between cells: a short step of a remote state's verification

    # --- lookup ---

    def take(self, prompt: Sequence[int], ns: str, session: str | None = None,
             progress: Callable[[str, int, int], None] | None = None, move: bool = False) -> Loan | None:
        """A loan of the longest usable cached prefix of `prompt` from any tier, or None (a miss).
        move=True: an entry the borrower will supersede hands over its buffers (ram.py)."""
        self.poll()
        if self.pressure is not None:
            self.pressure.check("lookup")
        prompt = as_token_array(prompt)  # once: the RAM and SSD lookups both compare arrays
        entry, n_ram = self.ram.best(prompt, ns, session)
        if self.store is not None:
            restored = self._restore_longer(prompt, ns, n_ram, progress, move)
            if restored is not None:
                return restored
        if self.remote is not None:
            fetched = self._fetch_remote(prompt, ns, n_ram)
            if fetched is not None:
                return fetched
        loan = self.ram.serve(entry, n_ram, prompt, ns, move)
        return loan if self.remote is None else self.remote.served(loan, ns)

    def _fetch_remote(self, prompt, ns, n_ram) -> Loan | None:
        t0 = time.perf_counter()
        try:
            cp = self.remote.lookup(prompt, ns, n_ram)
        except RemoteMiss as e:
            self.emit("restore_failed", ns=ns, source="remote", reason=str(e))
            return None
        if cp is None:
            return None
        entry = self.adopt(cp, ns)  # dirty: the write-through below stores its blocks locally
        if self.store is not None and self.durability.write_behind:
            self.durability.queue_dirty()
        self.emit("hit", ns=ns, source="remote", tokens=len(cp), prompt_tokens=len(prompt), nbytes=cp.nbytes,
                   seconds=time.perf_counter() - t0)
        loan = self.ram.lend(entry, len(cp), "remote")
        self.ram.enforce_budget()
        return loan

    def _restore_longer(self, prompt, ns, n_ram, progress, move) -> Loan | None:
        for _ in range(3):  # a file found to have lost a block left the index: the next longest one
            handle = self.store.find(prompt, ns, min_len=max(MIN_RESTORE_TOKENS, n_ram + 1))
            if handle is None:
                return None
            n = min(common_prefix_len(as_token_array(handle.tokens), prompt), len(prompt) - 1)
            if n <= n_ram or n < MIN_RESTORE_TOKENS:
                return None
            t0 = time.perf_counter()
            if progress is not None:
                progress("restore", 0, len(handle.tokens))
            cp, job = self.loading.read_now(handle, progress and (lambda done, total: progress("restore", done, total)))
            if cp is not None:
                break
            if self.store.contains(handle.tokens, ns):  # still there: a passing failure, prefill this time
                return None
        else:
            return None
        if progress is not None:
            progress("restore", len(handle.tokens), len(handle.tokens))
        if usable_length(cp, as_token_array(cp.tokens), prompt) != n:  # untrimmable entry that needs a trim
            self.emit("restore_skipped", ns=ns, tokens=len(cp.tokens), reason="untrimmable")
            if job.then:
                self.loading.adopt_job(job, cp)
            return None
        entry = self.loading.adopt_job(job, cp)
        self.counters["ssd_hits"] += 1
        self.counters["ssd_tokens"] += n
        self.emit("hit", ns=ns, source="ssd", tokens=n, prompt_tokens=len(prompt), nbytes=cp.nbytes,
                   seconds=time.perf_counter() - t0)
        loan = self.ram.lend(entry, n, "ssd", move)
        self.ram.enforce_budget()
        return loan

    def restore_exact(self, tokens: Sequence[int], ns: str) -> tuple[Entry | None, str | None]:
        """The entry of exactly `tokens` and where it came from ("ram"|"ssd"), or (None, None)."""
        tokens = tuple(tokens)
        entry = self.ram.get_exact(tokens, ns)
        if entry is not None or self.store is None:
            return entry, ("ram" if entry is not None else None)
        handle = self.store.find(tokens + (-1,), ns, min_len=len(tokens))  # sentinel: at most `tokens`
        if handle is None or handle.match_len != len(tokens):
            return None, None
        cp, job = self.loading.read_now(handle)
        if cp is None:
            return None, None
        self.counters["ssd_hits"] += 1
        if job.exact is None:
            job.exact = len(tokens)
            cp = cp.prefix(len(tokens)) if len(cp.tokens) > len(tokens) else cp
        return self.loading.adopt_job(job, cp), "ssd"

    # --- publication ---

    def put(self, checkpoint: Checkpoint, ns: str, *, evict: bool = True, defer_write: bool = False,
            session: str | None = None, prompt_tokens: int | None = None) -> Entry | None:
        """Publish in RAM (ram.py `put`); with write-behind, queue its persistence (defer_write:
        not until `queue_dirty()`). Returns the entry, or None if it was not kept."""
        entry = self.ram.put(checkpoint, ns, session=session, evict=False, prompt_tokens=prompt_tokens)
        if entry is not None:
            self.durability.published(entry, defer_write)
        if evict:
            self.ram.enforce_budget()
        return entry

    def adopt(self, cp: Checkpoint, ns: str) -> Entry:
        """Publish a checkpoint read back from SSD or the remote tier: resident at once.

        One larger than the RAM budget (or the room memory leaves, ram.py `cap`) is not published (nor
        evicted: no event); the returned entry is then detached, good for this one borrower only.
        """
        fits = self.ram.fits(cp.nbytes)
        entry = (self.ram.put(cp, ns, evict=False) if fits else None) or Entry(ns, cp, as_token_array(cp.tokens))
        self.durability.restored(entry)
        return entry

    def publish_remote(self, tokens: Sequence[int], ns: str) -> None:
        """Publish a committed checkpoint now: it was just named (remote_publish=named)."""
        if self.remote is not None and self.store is not None:
            info = self.store.file_info(ns, tokens)
            if info is not None:
                self.remote.published(info, self.store.blocks_root)

    # --- the RAM tier and the other parts, as the engine and the magics ask ---

    def entries(self, ns: str | None = None) -> list[Entry]:
        return self.ram.entries(ns)

    def get_exact(self, tokens: Sequence[int], ns: str) -> Entry | None:
        return self.ram.get_exact(tokens, ns)

    def lend(self, entry: Entry, n: int, source: str, move: bool = False) -> Loan:
        return self.ram.lend(entry, n, source, move)

    def session_entry(self, session: str, ns: str) -> Entry | None:
        return self.ram.session_entry(session, ns)

    def bind_session(self, session: str, entry: Entry) -> None:
        self.ram.bind_session(session, entry)

    def drop_session(self, session: str) -> None:
        self.ram.drop_session(session)

    def queue_dirty(self) -> None:
        self.durability.queue_dirty()

    def flush(self, timeout: float | None = None) -> dict:
        return self.durability.flush(timeout)

    def prefetch(self, ns: str) -> dict:
        return self.loading.prefetch(ns)

    def load(self, tokens: Sequence[int], ns: str, **kw) -> tuple[str | None, int]:
        return self.loading.load(tokens, ns, **kw)

    def reclaim(self, nbytes: int, reason: str = "pressure") -> int:
        return self.ram.reclaim(nbytes, reason)

    @property
    def has_ssd(self) -> bool:
        return self.store is not None

    def on_ssd(self, tokens: Sequence[int], ns: str) -> bool:
        return self.store is not None and self.store.contains(tokens, ns)

    def ssd_keys(self) -> set:
        """(namespace, token key) of every committed SSD file."""
        return {(h.namespace, h.key) for h in self.store.entries()} if self.store is not None else set()

    @property
    def catalog(self):
        """The shared catalogue of the SSD directory (None without an SSD tier)."""
        return self.store.catalog if self.store is not None else None

    # --- views ---

    def rows(self) -> list[dict]:
        """Every RAM and SSD entry as plain data (see `CacheAdmin.entries`)."""
        files = {(h.namespace, tuple(h.tokens)): h for h in self.store.entries()} if self.store else {}
        rows = []
        for e in self.ram.entries():
            h = files.pop((e.ns, e.tokens), None)
            rows.append({
                "ns": e.ns, "tokens": e.tokens, "tier": "ram" if h is None else "ram+ssd",
                "write_state": e.write_state.value, "ram_bytes": e.nbytes, "ram_own_bytes": self.ram.own_bytes(e),
                "kv_bytes": e.checkpoint.kv_bytes,
                "file_bytes": None if h is None else h.file_bytes + h.block_bytes,
                "borrowers": e.borrowers, "sessions": sorted(e.sessions), "last_used": e.last_used_time, "hits": e.hits,
            })
        for (ns, tokens), h in files.items():
            rows.append({
                "ns": ns, "tokens": tokens, "tier": "ssd", "write_state": WriteState.COMMITTED.value,
                "ram_bytes": None, "ram_own_bytes": None, "kv_bytes": h.raw_bytes,
                "file_bytes": h.file_bytes + h.block_bytes,
                "borrowers": 0, "sessions": [], "last_used": h.last_use, "hits": 0,
            })
        return rows

    def prefixes(self) -> list[Cached]:
        """Every cached prompt prefix in RAM and on SSD, as why.py compares prompts with them."""
        return cached_prefixes(self.ram.entries(), self.store.entries() if self.store is not None else (),
                               self.identities)

    def stats(self) -> dict:
        out = {
            "ram_used_bytes": self.ram.used_bytes,
            "ram_kv_bytes": self.ram.kv_bytes(),
            "ram_budget_bytes": self.ram.budget_bytes,
            "ram_entries": len(self.ram.entries()),
            "ssd_enabled": self.store is not None,
            **self.durability.stats(),
            **self.counters,
            **self.loading.stats(),
        }
        if self.store is not None:
            out.update({f"ssd_{k}": v for k, v in self.store.stats().items()})
        out.update(remote_stats(self.remote))
        return out

    # --- maintenance ---

    def gc_files(self, dry_run: bool = False, quarantine: bool = False) -> dict:
        """Stale temp files and orphans (quarantined files too with `quarantine`): removed (or, dry_run, listed)."""
        if self.store is None:
            return {"quarantine_removed": [], "quarantine_kept": 0, "temp_removed": []}
        return self.store.gc(dry_run, quarantine)

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
        self.loading.cancel_reads()
        if ssd or self.store is None:
            self.ram.clear()
            if ssd and self.store is not None:
                self.store.clear()
            return 0
        kept = 0
        for e in self.ram.entries():
            if self.store.has_durable_prefix(e.tokens, e.ns):
                self.ram.remove(e, reason="cleared")
            else:
                kept += 1
        return kept

    def close(self) -> None:
        self.loading.close_reader()
        if self.writer is not None:
            self.writer.close()
            self.store.close()
        if self.remote is not None:
            self.remote.tier.close()
