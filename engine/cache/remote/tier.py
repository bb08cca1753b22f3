"""RemoteTier: KV blocks and prefix records in Redis / Valkey (one server or a cluster).

    <prefix>:<key id>:blk:<keyed block id>   a block's or manifest's bytes, encrypted, TTL ttl_s
    <prefix>:<key id>:rec:<prefix key>       a sealed chain record per full block of a prefix
    <prefix>:<key id>:crec:<prefix key>      the same, of a checkpoint reusable from an offset on (converted KV)
    <prefix>:<key id>:ext:<prefix key>       a sealed exact record (a state exact at its own length)
    <prefix>:<key id>:obj:<namespace root>   a sealed object record (an exact tensor object, find_object)
    <prefix>:<key id>:tomb:<prefix key>      a signed tombstone: remove() was here (records.Tombstone)
    <prefix>:<key id>:lay:<layout id>        a publication's layout, once for all its chain records

Reads use read commands only (STRLEN, GETRANGE), so a read-only ACL user
or a replica serves lookups, and every read is bounded before it is made:
a record is read with one GETRANGE of MAX_RECORD_BYTES (a reply that fills
it is of a longer value: refused, so no STRLEN is needed); a block or manifest is
read only after STRLEN says it is exactly the size its record or layout
promised, and then with GETRANGE of that size. A value of the wrong size
or type, a record that does not verify, a block that does not hash to its
name: each is a counted miss, never an exception, never a download of
whatever someone planted. A bad block is also removed (best effort), so
the next publisher uploads it again. Publication is publish.py's; block
values are read (get_blocks) by reads.py.

Every call goes through the breaker and comes back as a result or a
redacted RemoteError (client.py); a lookup carries a deadline. The engine
sees only results, RemoteMiss from reads and failure strings from wait().
Thread safety: any thread may call in; the clients and their connection
pools are thread-safe, counters sit under a lock.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from .breaker import Breaker
from .client import GuardedClient, RemoteError, describe
from .config import parse_remote_url, reveal
from .keys import OPEN, KeySpace, TeamKeys, team_keys
from .meter import Meter, fetch_beats_recompute
from .publish import Publication
from .reads import GET_BATCH, BlockReads, RemoteMiss, time_left
from .records import (CHAIN, CONVERTED, EXACT, MAX_AGE_S, MAX_RECORD_BYTES, OBJECT, TOMB, ExactRecord,
                      ObjectRecord, chain_signature, names_digest, open_layout, unseal)
from .writers import NO_WRITER, SigningKey, Writers

PROBE_BATCH = 16  # prefix keys per round trip
SIGNATURE_TRIES = 4  # chain records a lookup verifies, from the end of its run, before it gives up
MIN_FETCH_TOKENS = 256  # below this, recomputing is cheaper than any round trip worth making
LAYOUTS_KEPT = 64  # layouts a tier remembers (one per publication a lookup ended on; ~3 KB each)
COUNTERS = ("hits", "misses", "bytes_read", "bytes_written", "blocks_uploaded", "blocks_skipped", "records_written",
            "records_found", "probes", "mac_rejected", "malformed", "stale", "wrong_size", "bad_blocks",
            "unknown_writer", "signature_rejected", "tombstoned", "layouts_read", "layout_missing")


@dataclass
class Found:
    """What a probe found: the run of usable chain records, and the longest matching exact record."""

    records: list = field(default_factory=list)
    exact: ExactRecord | None = None
    key_id: str = ""
    chain: list = field(default_factory=list)  # the prefix keys probed (for touch())
    writer: str = ""  # hex id of the writer whose signature vouches for `records` ("" unsigned, no allow-list)
    converted: bool = False  # `records` are of the converted chain (records.CONVERTED)
    layout: bytes | None = None  # the layout JSON of records[-1] (verified against its id)


class RemoteTier(BlockReads, Publication):
    def __init__(self, url: str, *, secret=None, insecure: bool = False, ttl_s: int = 7 * 24 * 3600,
                 timeout_s: float = 1.0, key_prefix: str = "mlxcache", probe_batch: int = PROBE_BATCH,
                 min_fetch_tokens: int = MIN_FETCH_TOKENS, margin: float = 1.5, breaker: Breaker | None = None,
                 max_pending: int = 64, tls: dict | None = None, max_age_s: float | None = None,
                 password: str | None = None, signing_key=None, writers=None):
        """secret: the team secret (16+ bytes), or [current, previous...] while rotating: records are
        sealed with the first and read under each. No secret is refused unless insecure=True.
        password: the server's, when the URL has none; tls: ca_file, cert_file, key_file (rediss://).
        signing_key: this writer's Ed25519 key (writers.py; None: records go unsigned, and with an
        allow-list nothing is published); writers: the allow-list of public keys (None or empty:
        any holder of the secret is trusted, MAC only)."""
        self.config = parse_remote_url(url)
        if password and not self.config.password:
            self.config = dataclasses.replace(self.config, password=reveal(password))
        self.keys = team_keys(secret)  # no raw secret is ever a variable of this frame (a traceback shows them)
        if not self.keys[0].authenticated and not insecure:
            raise ValueError(f"remote tier {self.url}: no team secret (or choose insecure=True by name)")
        if not isinstance(ttl_s, int) or ttl_s < 1:
            raise ValueError(f"ttl_s must be a positive whole number of seconds, got {ttl_s!r}")
        if not timeout_s > 0 or not probe_batch >= 1:
            raise ValueError("timeout_s must be > 0 and probe_batch >= 1")
        self.ttl_s, self.timeout_s, self.probe_batch = ttl_s, float(timeout_s), probe_batch
        self.min_fetch_tokens, self.margin = min_fetch_tokens, margin
        self.spaces = {k.key_id: KeySpace(k, key_prefix) for k in self.keys}
        self.max_age_s = MAX_AGE_S if max_age_s is None else max_age_s
        self.breaker = breaker or Breaker()
        self.meter = Meter()
        self._layouts: collections.OrderedDict = collections.OrderedDict()  # (key id, layout id) -> layout JSON
        self.signer = None if signing_key is None else SigningKey.load(signing_key)
        self.writers = Writers.parse(writers)
        if tls and not self.config.tls:
            raise ValueError(f"TLS files given for {self.url!r}, which is not TLS (use rediss://)")
        self.reader = GuardedClient(self.config, self.timeout_s, self.breaker, tls)
        self.writer = GuardedClient(self.config, self.timeout_s, self.breaker, tls)  # cut apart from lookups
        self._lock = threading.Lock()  # counters
        self._counts = dict.fromkeys(COUNTERS, 0)
        BlockReads.__init__(self)
        Publication.__init__(self, max_pending)

    @property
    def url(self) -> str:
        """The URL with user and password hidden."""
        return self.config.redacted

    @property
    def authenticated(self) -> bool:
        return self.keys[0].key_id != OPEN

    def __repr__(self) -> str:
        kind = "cluster" if self.config.cluster else "server"
        auth = f"key id {self.keys[0].key_id}" if self.authenticated else "UNAUTHENTICATED"
        return f"RemoteTier({self.url!r}, {kind}, {auth}, {self.writers!r}, breaker={self.breaker.state()!r})"

    @property
    def may_publish(self) -> bool:
        """False for a member without a signing key in a team with an allow-list: its records would be refused."""
        return self.signer is not None or not self.writers

    # --- lookup ---

    def probe(self, namespace: str, tokens: Sequence[int], block_size: int, *, deadline: float | None = None,
              exact: bool = False, converted: bool = False) -> Found:
        """The longest run of leading full blocks of `tokens` the remote holds chain records for and,
        with exact=True, the longest exact record whose tokens are a prefix of `tokens`. With
        converted=True the converted chain is read too (in the same round trips), and its run is
        taken when it is longer and reaches its minimum reusable offset.
        Under each secret in turn (rotation); an empty Found on any failure. `deadline`: monotonic."""
        self.count(probes=1)
        for keys in self.keys:
            if keys.not_after is not None and keys.not_after <= time.time():
                continue  # ended while this process ran
            found = self._probe(keys, namespace, tokens, block_size, deadline, exact, converted)
            if found.records or found.exact:
                self.count(records_found=len(found.records))
                return found
            if deadline is not None and time.monotonic() >= deadline:
                break  # the next secret's key space would only be "no time left"
        return Found()

    def _probe(self, keys: TeamKeys, namespace, tokens, block_size, deadline, exact, converted) -> Found:
        chain, space = keys.prefix_keys(namespace, tokens, block_size), self.spaces[keys.key_id]
        found, plain, now = Found(key_id=keys.key_id, chain=chain), True, time.time()
        names = [space.record] + [space.exact] * exact + [space.converted] * converted  # read per key, in order
        step, runs = len(names), {CHAIN: True, CONVERTED: converted}  # which chains still continue
        conv: list = []

        def fill(p, chunk):
            for k in chunk:
                for name in names:
                    p.getrange(name(k), 0, MAX_RECORD_BYTES - 1)

        def record(kind, k, i, reply):
            rec = self._unseal(kind, k, reply, keys, now)
            if rec is not None and (rec.namespace, rec.index, rec.start, rec.end) != (
                    namespace, i, i * block_size, (i + 1) * block_size):
                self.count(malformed=1)
                return None
            return rec

        for first in range(0, len(chain), self.probe_batch):
            chunk = chain[first:first + self.probe_batch]
            t0 = time.perf_counter()
            try:
                replies = self.reader.pipeline("probe", lambda p, c=chunk: fill(p, c), time_left(deadline))
            except RemoteError:
                break  # counted; the records already verified stay good
            self.meter.round_trip(time.perf_counter() - t0)
            for i, k in enumerate(chunk, first):
                r = replies[(i - first) * step:(i - first + 1) * step]
                if runs[CHAIN]:
                    xs = self._unseal(EXACT, k, r[1], keys, now) if exact else None
                    if xs is not None and xs.namespace == namespace and xs.index == i:
                        fits = [x for x in xs.states if x.length(block_size) <= len(tokens)
                                and tuple(tokens[(i + 1) * block_size:x.length(block_size)]) == x.tail]
                        found.exact = max(fits, key=lambda x: len(x.tail), default=found.exact)
                    rec = record(CHAIN, k, i, r[0])
                    runs[CHAIN] = rec is not None
                    plain = plain and rec is not None and rec.layout_id is not None and rec.block is not None
                    if plain:
                        found.records.append(rec)
                if runs[CONVERTED]:
                    rec = record(CONVERTED, k, i, r[-1])
                    runs[CONVERTED] = rec is not None and rec.layout_id is not None and rec.block is not None
                    if runs[CONVERTED]:
                        conv.append(rec)
                if not any(runs.values()):
                    break
            else:
                continue
            break
        plain_run = found.records
        if len(conv) > len(plain_run) and len(conv) * block_size >= conv[-1].min_offset:
            found.records, found.converted = conv, True
            self._settle(found, keys, namespace, deadline, now)
            if found.records and len(found.records) * block_size >= found.records[-1].min_offset:
                return found
            # Cut below its start (unsigned or removed records after it): it serves nothing, and the
            # plain run is still what it was (a non-member's converted records cannot hide it).
            found.records, found.converted, found.writer, found.layout = plain_run, False, "", None
        self._settle(found, keys, namespace, deadline, now)
        return found

    def _settle(self, found: Found, keys: TeamKeys, namespace: str, deadline, now: float) -> None:
        """Cut a probe's run to what its signatures, tombstones and layout allow (one round trip)."""
        self._vouched(found, self._removals(found, keys, namespace, deadline, now))
        self._layout_of(found, keys)

    def _removals(self, found: Found, keys: TeamKeys, namespace: str, deadline, now: float) -> dict:
        """{index: issue time} of the tombstones at the keys a hit can end on (the last SIGNATURE_TRIES
        of the run, the exact record's): only the record a hit ends on needs to be no older than its
        key's removal, since its signature vouches for the names before it. The same round trip reads
        the layouts those records name that this tier does not remember (into self._layouts). One
        round trip, none for a miss; unreadable: every candidate counts as removed (a miss)."""
        idx = sorted({*range(max(0, len(found.records) - SIGNATURE_TRIES), len(found.records)),
                      *((found.exact.index,) if found.exact is not None else ())})
        space = self.spaces[keys.key_id]
        wanted = list(dict.fromkeys(r.layout_id for r in found.records[-SIGNATURE_TRIES:]
                                    if r.layout_id is not None and (keys.key_id, r.layout_id) not in self._layouts))

        def fill(p):
            for i in idx:
                p.getrange(space.tomb(found.chain[i]), 0, MAX_RECORD_BYTES - 1)
            for lid in wanted:
                p.getrange(space.layout(lid), 0, MAX_RECORD_BYTES - 1)

        try:
            replies = self.reader.pipeline("tombstones", fill, time_left(deadline)) if idx else []
        except RemoteError:
            return dict.fromkeys(idx, 1 << 62)
        out = {}
        for n, i in enumerate(idx):
            t = self._unseal(TOMB, found.chain[i], replies[n], keys, now)
            out[i] = t.issued if t is not None and (t.namespace, t.index) == (namespace, i) else -1
        for n, lid in enumerate(wanted, len(idx)):
            value = self._value_of(replies[n])
            layout = None if value is None else open_layout(lid, value, keys)
            if layout is not None:
                self.count(layouts_read=1)
                self._layouts[keys.key_id, lid] = layout
                while len(self._layouts) > LAYOUTS_KEPT:
                    self._layouts.popitem(last=False)
            elif value is not None:
                self.count(malformed=1)
        return out

    def _layout_of(self, found: Found, keys: TeamKeys) -> None:
        """found.layout from the layout its last record names; none (evicted, expired, or not the
        layout of that id): the run serves nothing, counted."""
        lid = found.records[-1].layout_id if found.records else None
        found.layout = None if lid is None else self._layouts.get((keys.key_id, lid))
        if found.layout is not None:
            self._layouts.move_to_end((keys.key_id, lid))
        elif found.records:
            self.count(layout_missing=1)
            found.records.clear()

    def _vouched(self, found: Found, removed: dict) -> None:
        """Cut found.records to the longest run whose last record is not removed (its key's tombstone
        is older) and is signed, over the names of the whole run, by an allow-listed writer (trying
        SIGNATURE_TRIES from the end; without an allow-list, not removed is enough); none: empty.
        An exact record issued before its key's removal is dropped."""
        x = found.exact
        if x is not None and x.issued <= removed.get(x.index, -1):
            self.count(tombstoned=1)  # a removed record written back: a miss
            found.exact = None
        records, digests, d = found.records, [], b""
        for r in records if self.writers else ():
            d = names_digest(d, r.block)
            digests.append(d)
        for j in range(len(records) - 1, max(-1, len(records) - 1 - SIGNATURE_TRIES), -1):
            if records[j].issued <= removed.get(j, -1):
                self.count(tombstoned=1)
                continue
            why = chain_signature(found.chain[j], records[j], digests[j], self.writers) if self.writers else None
            if why is None:
                del records[j + 1:]
                found.writer = "" if records[j].writer == NO_WRITER else records[j].writer.hex()
                return
            self.count(**{"signature_rejected" if why == "signature" else why: 1})
        records.clear()

    def find_object(self, namespace: str, *, deadline: float | None = None) -> ObjectRecord | None:
        """The record of the exact tensor object in `namespace` (cache/objects/remote.py), under each secret
        in turn; None when there is none or it does not verify."""
        self.count(probes=1)
        now = time.time()
        for keys in self.keys:
            name = self.spaces[keys.key_id].object(keys.root(namespace))
            try:
                reply, = self.reader.pipeline("find object", lambda p: (p.getrange(name, 0, MAX_RECORD_BYTES - 1),),
                                              time_left(deadline))
            except RemoteError:
                return None
            rec = self._unseal(OBJECT, keys.root(namespace), reply, keys, now)
            if rec is not None and rec.namespace == namespace:
                self.count(records_found=1)
                return rec
        return None

    def _value_of(self, value) -> bytes | None:
        """The whole value a GETRANGE of MAX_RECORD_BYTES read, or None (counted unless simply absent)."""
        if value == b"":
            return None
        if not isinstance(value, bytes):
            self.count(malformed=1)  # a wrong type planted at the key (the server's error)
            return None
        if len(value) >= MAX_RECORD_BYTES:
            self.count(wrong_size=1)  # the first MAX_RECORD_BYTES of a longer value
            return None
        return value

    def _unseal(self, kind: str, key: bytes, reply, keys: TeamKeys, now: float):
        """A record from a GETRANGE reply, or None (counted unless simply absent)."""
        value = self._value_of(reply)
        if value is None:
            return None
        rec, why = unseal(kind, key, value, keys, now=now, max_age_s=self.max_age_s, writers=self.writers)
        if why is not None:
            self.count(**{"mac_rejected" if why == "mac" else "signature_rejected" if why == "signature" else why: 1})
        return rec

    def worth_fetching(self, n_tokens: int, bytes_per_token: float, prefill_tokens_per_s: float, *,
                       block_size: int = 256) -> bool:
        """Is reading `n_tokens` of KV from the remote estimated faster than prefilling them?

        Uses the measured latency and GET bandwidth (priors until measured);
        False for short prefixes and while the breaker is open."""
        if self.breaker.is_open():
            return False
        return fetch_beats_recompute(self.meter, n_tokens, bytes_per_token, prefill_tokens_per_s,
                                     block_size=block_size, probe_batch=self.probe_batch, get_batch=GET_BATCH,
                                     min_tokens=self.min_fetch_tokens, margin=self.margin)

    # --- state ---

    def stats(self) -> dict:
        with self._lock:
            counts = dict(self._counts)
        errors = self.reader.errors + self.writer.errors
        return {"url": self.url, "cluster": self.config.cluster, "tls": self.config.tls,
                "authenticated": self.authenticated, "key_id": self.keys[0].key_id, **counts, "errors": errors,
                "writers": len(self.writers.keys), "signing": self.signer is not None,
                "deadline_missed": self.reader.deadlines_missed + self.writer.deadlines_missed,
                "skipped_breaker_open": self.reader.not_tried + self.writer.not_tried,
                "breaker": self.breaker.state(), "last_error": self.breaker.last_error,
                "get_bandwidth_bytes_per_s": self.meter.bandwidth, "latency_s": self.meter.latency_s,
                **self.publication_stats()}

    def close(self, timeout: float | None = 5.0) -> list[str]:
        """Wait (bounded) for queued publications, stop the publisher, drop connections; return what
        was not published (and other failures)."""
        failures = self.close_publisher(timeout)
        self.close_reads()
        self.reader.close()
        self.writer.close()
        return failures

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- helpers ---

    def count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _describe(self, exc: BaseException) -> str:
        return describe(exc, self.config)

