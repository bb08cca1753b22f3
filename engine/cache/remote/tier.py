"""RemoteTier: KV blocks and prefix records in Redis / Valkey (one server or a cluster).

    <prefix>:blk:<blake3 hex>     a block's bytes verbatim (the SSD block file), TTL ttl_s
    <prefix>:rec1:<prefix key>    a sealed record per full block of a published prefix, TTL ttl_s

- publish(): queued, then on the publisher thread: EXPIRE each block (one
  command both asks "present?" and refreshes a present block's TTL), SET the
  missing ones with EX, then one record per full block. Blocks go before the
  records naming them, so a record found is a block that was stored (unless
  evicted since, which a read sees as a miss).
- probe(): records of the longest run of leading blocks, pipelined batches of
  prefix keys, stopping at the first miss or rejected record.
- get_blocks(): pipelined GETs, each value verified against its name.

Every call to the server goes through the breaker and comes back as a
result or a redacted RemoteError (client.py). The engine sees only
RemoteMiss from reads and failure strings from wait(); it knows nothing of
Redis, and this module nothing of MLX. Thread safety: any thread may call
in; the client and its connection pool are thread-safe, counters sit under
a lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .breaker import Breaker
from .client import GuardedClient, RemoteError, describe
from .config import parse_remote_url
from .keys import KeySpace, block_name, is_block_name, namespace_root, prefix_keys, token_blocks
from .meter import Meter, fetch_beats_recompute
from .publisher import Publisher
from .records import RemoteRecord, encode_layout, mac_key, seal, unseal


PROBE_BATCH = 16  # prefix keys per round trip: 16 blocks of 256 tokens = 4k tokens per trip
GET_BATCH = 8  # block values per round trip: at most 8 x 4 MB in flight
META_BATCH = 256  # small commands (EXPIRE, record SET, UNLINK) per pipeline
UPLOAD_BATCH_BYTES = 64 << 20  # bytes of block values per upload pipeline (bounds memory)
MIN_FETCH_TOKENS = 256  # below this, recomputing is cheaper than any round trip worth making
COUNTERS = ("hits", "misses", "bytes_read", "bytes_written", "blocks_uploaded", "blocks_skipped",
            "records_written", "records_found", "probes", "mac_rejected")


class RemoteMiss(Exception):
    """Blocks could not be read and verified: a cache miss, never a wrong answer.

    `blocks` holds the verified values read before the miss, in order (a
    shorter prefix the caller may still use)."""

    def __init__(self, message: str, blocks: list[bytes] | None = None):
        super().__init__(message)
        self.blocks = blocks or []


@dataclass
class _Job:
    namespace: str
    root: bytes
    tokens: np.ndarray  # (n_blocks, block_size) int32, a copy
    blocks: list  # [(name, fetch)] for blocks 0..len-1
    layout_json: str


def _chunks(seq: Sequence, n: int):
    return (seq[i:i + n] for i in range(0, len(seq), n))


class RemoteTier:
    def __init__(self, url: str, *, secret: bytes | None = None, salt: str = "", ttl_s: int = 7 * 24 * 3600,
                 timeout_s: float = 2.0, key_prefix: str = "mlxcache", probe_batch: int = PROBE_BATCH,
                 min_fetch_tokens: int = MIN_FETCH_TOKENS, margin: float = 1.5, breaker: Breaker | None = None,
                 max_pending: int = 64, tls_ca_file: str | None = None):
        self.config = parse_remote_url(url)
        if not isinstance(ttl_s, int) or ttl_s < 1:
            raise ValueError(f"ttl_s must be a positive whole number of seconds, got {ttl_s!r}")
        if not timeout_s > 0 or not probe_batch >= 1:
            raise ValueError("timeout_s must be > 0 and probe_batch >= 1")
        self.ttl_s, self.timeout_s, self.probe_batch = ttl_s, float(timeout_s), probe_batch
        self.min_fetch_tokens, self.margin = min_fetch_tokens, margin
        self._mac_key = mac_key(secret)
        namespace_root("check", salt)  # a bad salt fails here, not at the first probe
        self._salt = salt
        self.keys = KeySpace(key_prefix)
        self.breaker = breaker or Breaker()
        self.meter = Meter()
        if tls_ca_file is not None and not self.config.tls:
            raise ValueError(f"tls_ca_file given for {self.url!r}, which is not TLS (use rediss://)")
        self.server = GuardedClient(self.config, self.timeout_s, self.breaker, tls_ca_file)
        self._lock = threading.Lock()  # counters
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._publisher = Publisher(self._publish_now, self._describe, max_pending=max_pending)

    @property
    def url(self) -> str:
        """The URL with user and password hidden."""
        return self.config.redacted

    def __repr__(self) -> str:
        kind = "cluster" if self.config.cluster else "server"
        return f"RemoteTier({self.url!r}, {kind}, breaker={self.breaker.state()!r})"

    # --- publication (background) ---

    def publish(self, namespace: str, tokens: Sequence[int], block_size: int,
                blocks: list[tuple[str, Callable[[], bytes]]], layout: dict) -> bool:
        """Queue publication of the prefix whose full blocks are `blocks` (name, bytes getter), in order.

        Returns at once: False if the job could not be queued (reported by
        wait()). Raises only for malformed arguments, a bug in the caller."""
        root = namespace_root(namespace, self._salt)
        arr = token_blocks(tokens, block_size)  # a copy: the caller may reuse its list
        if len(blocks) > len(arr):
            raise ValueError(f"{len(blocks)} blocks given for {len(arr)} full blocks of {block_size} tokens")
        for item in blocks:
            if not (isinstance(item, tuple) and len(item) == 2 and is_block_name(item[0]) and callable(item[1])):
                raise ValueError(f"each block must be (64-hex BLAKE3 name, callable returning bytes), got {item!r:.80}")
        if not blocks:
            return True
        job = _Job(namespace, root, arr[: len(blocks)], list(blocks), encode_layout(layout))
        return self._publisher.submit(job, f"publish {len(blocks)} blocks of {namespace[:40]}")

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait for queued publications; return the failures since the last wait (redacted strings)."""
        return self._publisher.wait(timeout)

    def _publish_now(self, job: _Job) -> None:
        bs = job.tokens.shape[1]
        keys = prefix_keys(job.root, job.tokens.ravel(), bs)
        unique = dict(job.blocks)  # name -> fetch, in block order
        names = list(unique)
        present: set[str] = set()
        for chunk in _chunks(names, META_BATCH):
            found = self._pipe("publish: check blocks", lambda p, c=chunk: [p.expire(self.keys.block(n), self.ttl_s)
                                                                           for n in c])
            present.update(n for n, f in zip(chunk, found) if f)
        self._count(blocks_skipped=len(present))
        failure = self._upload([(n, f) for n, f in unique.items() if n not in present])
        # Records for the blocks before a block that could not be uploaded: probes stop at the gap anyway.
        usable = len(job.blocks) if failure is None else [n for n, _ in job.blocks].index(failure[0])
        recs = [(keys[i], RemoteRecord(i, i * bs, (i + 1) * bs, job.blocks[i][0], job.namespace)) for i in range(usable)]
        for chunk in _chunks(recs, META_BATCH):
            values = [(self.keys.record(k), seal(k, r, job.layout_json, self._mac_key)) for k, r in chunk]
            self._pipe("publish: write records", lambda p, v=values: [p.set(k, x, ex=self.ttl_s) for k, x in v])
            self._count(records_written=len(values), bytes_written=sum(len(x) for _, x in values))
        if failure is not None:
            raise RemoteError(f"block {failure[0][:16]}: {failure[1]}; published the first {usable} blocks only")

    def _upload(self, missing: list) -> tuple[str, str] | None:
        """SET the missing blocks in byte-bounded pipelines; (name, why) of a block that could not be read."""
        batch: list[tuple[str, bytes]] = []
        size, failure = 0, None
        for name, fetch in missing:
            try:
                value = fetch()
                value = bytes(value) if isinstance(value, (bytearray, memoryview)) else value  # redis-py takes bytes
            except Exception as e:  # noqa: BLE001 - the local copy went away: publish what came before it
                failure = (name, f"could not be read for upload ({self._describe(e)})")
                break
            if not isinstance(value, bytes) or block_name(value) != name:
                failure = (name, "its bytes do not hash to its name, not uploaded")
                break
            batch.append((name, value))
            size += len(value)
            if size >= UPLOAD_BATCH_BYTES:
                self._set_blocks(batch)
                batch, size = [], 0
        if batch:
            self._set_blocks(batch)
        return failure

    def _set_blocks(self, batch: list[tuple[str, bytes]]) -> None:
        self._pipe("publish: upload blocks", lambda p: [p.set(self.keys.block(n), v, ex=self.ttl_s) for n, v in batch])
        self._count(blocks_uploaded=len(batch), bytes_written=sum(len(v) for _, v in batch))

    # --- lookup ---

    def probe(self, namespace: str, tokens: Sequence[int], block_size: int) -> list[RemoteRecord]:
        """Records of the longest run of leading full blocks the remote holds ([] on any failure)."""
        keys = prefix_keys(namespace_root(namespace, self._salt), tokens, block_size)
        found: list[RemoteRecord] = []
        self._count(probes=1)
        for first in range(0, len(keys), self.probe_batch):
            chunk = keys[first:first + self.probe_batch]
            t0 = time.perf_counter()
            try:
                # GETEX: a record (and below, a block) in use lives another TTL
                values = self._pipe("probe", lambda p: [p.getex(self.keys.record(k), ex=self.ttl_s) for k in chunk])
            except RemoteError:
                break  # counted; the records already verified stay good
            self.meter.round_trip(time.perf_counter() - t0)
            for i, (k, v) in enumerate(zip(chunk, values), first):
                if v is None:
                    break
                rec = unseal(k, v, self._mac_key)
                if rec is None or (rec.index, rec.start, rec.end, rec.namespace) != (
                        i, i * block_size, (i + 1) * block_size, namespace):
                    self._count(mac_rejected=1)
                    break
                found.append(rec)
            if len(found) < first + len(chunk):
                break
        self._count(records_found=len(found))
        return found

    def get_blocks(self, names: Sequence[str]) -> list[bytes]:
        """The values of `names`, each verified by BLAKE3; RemoteMiss if any is missing, bad or unreadable."""
        names = list(names)
        out: list[bytes] = []
        why = next((f"not a block name: {n!r:.80}" for n in names if not is_block_name(n)), None)
        for chunk in ([] if why else _chunks(names, GET_BATCH)):
            t0 = time.perf_counter()
            try:
                values = self._pipe("read blocks",
                                    lambda p, c=chunk: [p.getex(self.keys.block(n), ex=self.ttl_s) for n in c])
            except RemoteError as e:
                why = str(e)
                break
            n_bytes = sum(len(v) for v in values if isinstance(v, bytes))
            self._count(bytes_read=n_bytes)
            self.meter.transfer(n_bytes, time.perf_counter() - t0)
            for n, v in zip(chunk, values):
                if not isinstance(v, bytes):
                    why = f"block {n[:16]} is not in the remote (evicted or expired)"
                elif block_name(v) != n:
                    why = f"block {n[:16]} failed verification ({len(v)} bytes that do not hash to its name)"
                else:
                    out.append(v)
                    continue
                break
            if why:
                break
        self._count(hits=len(out), misses=len(names) - len(out))
        if why:
            raise RemoteMiss(why, out)
        return out

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

    # --- deletion ---

    def remove(self, namespace: str, tokens: Sequence[int], block_size: int) -> int:
        """UNLINK the prefix records of `tokens` (blocks stay: other prefixes may name them; their TTL ends them)."""
        keys = [self.keys.record(k) for k in prefix_keys(namespace_root(namespace, self._salt), tokens, block_size)]
        return self._unlink(keys)

    def remove_blocks(self, names: Sequence[str]) -> int:
        if not all(is_block_name(n) for n in names):
            raise ValueError("remove_blocks takes 64-hex BLAKE3 block names")
        return self._unlink([self.keys.block(n) for n in names])

    def _unlink(self, keys: list[str]) -> int:
        # One UNLINK per key: a multi-key UNLINK spanning slots is refused by a cluster.
        return sum(sum(self._pipe("unlink", lambda p, c=c: [p.unlink(k) for k in c])) for c in _chunks(keys, META_BATCH))

    # --- state ---

    def stats(self) -> dict:
        with self._lock:
            counts = dict(self._counts)
        return {"url": self.url, "cluster": self.config.cluster, "tls": self.config.tls, **counts,
                "errors": self.server.errors, "skipped_breaker_open": self.server.not_tried,
                "breaker": self.breaker.state(), "last_error": self.breaker.last_error,
                "get_bandwidth_bytes_per_s": self.meter.bandwidth, "latency_s": self.meter.latency_s,
                "publish_pending": self._publisher.pending(), "publish_failed": self._publisher.failed_total}

    def close(self, timeout: float | None = 5.0) -> list[str]:
        """Wait (bounded) for queued publications, stop the publisher, drop connections; return failures."""
        failures = self._publisher.close(timeout)
        self.server.close()
        return failures

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- helpers ---

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._counts[k] += v

    def _describe(self, exc: BaseException) -> str:
        return describe(exc, self.config)

    def _pipe(self, what: str, fill: Callable) -> list:
        return self.server.pipeline(what, fill)
