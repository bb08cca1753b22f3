"""Publication to the remote tier, on the publisher thread: values first, then the records naming them.

- publish(): a prefix made of token spans. STRLEN of each block (with an
  EXPIRE: a block in use lives another TTL); a block is present only if its
  remote size is its local size, so a planted, truncated or foreign value
  at its key is uploaded again (SET replaces it). Then its layout, once
  (records.seal_layout), and one chain record per full block naming it, SET
  with a fresh issue time and TTL. A layout with a minimum
  reusable offset (KV quantized from kv_start) goes to the converted chain
  (records.CONVERTED), so it never replaces the full-precision blocks that
  shorter prompts of the same prefix are served from.
- publish_exact(): a state exact only at its own length (recurrent layers,
  a wrapped ring). Its manifest (read now, named by its BLAKE3) and every
  block it names are uploaded the same way; then chain markers for its full
  blocks (SET NX: a plain record already there stays) and its exact record.
- touch() / remove_bad(): best effort after a read, queued here: EXPIRE
  what a hit used, UNLINK a value that failed verification. A reader
  without write permission (a read-only ACL user, a replica) is refused
  once and skips them from then on.

Records are signed with this writer's key (writers.py); a member without
one, in a team with an allow-list, publishes nothing (`may_publish`).
Blocks go before the records naming them, so a record found is a value
that was stored (unless evicted since, which a read sees as a miss). Each
call has a deadline from its bytes, so a dripping server cannot hold the
publisher (or `close()`) forever.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from redis.exceptions import NoPermissionError, ReadOnlyError, ResponseError

from .client import RemoteError
from .keys import AEAD_OVERHEAD, block_name, is_block_name
from .publish_queue import Publisher
from .records import (CHAIN, CONVERTED, EXACT, MAX_RECORD_BYTES, MAX_SKEW_S, ExactRecord, ObjectRecord, RemoteRecord, encode_layout,
                      names_digest, seal_chain, seal_exact, seal_layout, seal_object, seal_tomb, unseal)

META_BATCH = 256  # small commands per pipeline
UPLOAD_BATCH_BYTES = 64 << 20  # bytes of values per upload pipeline (bounds memory)
MIN_UPLOAD_BYTES_PER_S = 1 << 20  # a publication call may take its bytes at this rate, then it is cut


@dataclass(frozen=True)
class Value:
    """A block (or manifest) to publish: its BLAKE3 name, size and a getter of its bytes."""

    name: str
    size: int
    fetch: Callable[[], bytes]


def _chunks(seq: Sequence, n: int):
    return (seq[i:i + n] for i in range(0, len(seq), n))


def _denied(reply) -> bool:
    return isinstance(reply, (NoPermissionError, ReadOnlyError)) or (
        isinstance(reply, ResponseError) and str(reply).startswith(("NOPERM", "READONLY")))


class Publication:
    """The publishing half of RemoteTier (which provides keys, spaces, writer, ttl_s, max_age_s, count, _describe)."""

    def __init__(self, max_pending: int):
        self._publisher = Publisher(self._describe, max_pending=max_pending)
        self._denied: set[str] = set()  # best-effort commands the server refused (NOPERM, READONLY)
        self._removed = 0  # the second of this writer's last remove(): what it seals later is issued after it

    def publish(self, namespace: str, tokens: Sequence[int], block_size: int, blocks: Sequence[Value],
                layout: dict) -> bool:
        """Queue publication of the prefix whose full blocks are `blocks`, in order.

        Returns at once: False if the job could not be queued (reported by
        wait()). Raises only for malformed arguments, a bug in the caller."""
        if not self.may_publish:
            return True
        keys = self.keys[0]
        chain = keys.prefix_keys(namespace, tokens, block_size)
        blocks = _checked(blocks)
        if len(blocks) > len(chain):
            raise ValueError(f"{len(blocks)} blocks given for {len(chain)} full blocks of {block_size} tokens")
        if not blocks:
            return True
        layout_json = encode_layout(layout)
        kind = CONVERTED if layout.get("min_reusable_offset") else CHAIN
        job = lambda: self._publish_now(namespace, chain[:len(blocks)], block_size, blocks, layout_json, kind)  # noqa: E731
        return self._publisher.submit(job, f"publish {len(blocks)} blocks of {namespace[:40]}")

    def _publish_now(self, namespace: str, chain: list, bs: int, blocks: list, layout_json: str, kind: str) -> None:
        keys = self.keys[0]
        space = self.spaces[keys.key_id]
        where = space.converted if kind == CONVERTED else space.record
        failure = self._upload(blocks)
        # Records for the blocks before one that could not be uploaded: probes stop at the gap anyway.
        usable = len(blocks) if failure is None else [b.name for b in blocks].index(failure[0])
        layout_id, layout_value = seal_layout(layout_json, keys)
        now, digest, records = self._now(), b"", [(space.layout(layout_id), layout_value)]  # first: before its records
        for i, k in enumerate(chain[:usable]):
            digest = names_digest(digest, blocks[i].name)
            records.append((where(k), seal_chain(k, RemoteRecord(i, i * bs, (i + 1) * bs, blocks[i].name, namespace),
                                                 layout_json, keys, now, self.signer, digest, kind)))
        self._set_records(records)
        if failure is not None:
            raise RemoteError(f"block {failure[0][:16]}: {failure[1]}; published the first {usable} blocks only")

    def publish_exact(self, namespace: str, tokens: Sequence[int], block_size: int, blocks: Sequence[Value],
                      manifest: Callable[[], bytes]) -> bool:
        """Queue publication of a whole checkpoint of `tokens`: its manifest (read when the job runs)
        and every block it names. Needs at least one full block (its key hangs from one)."""
        n_full = len(tokens) // block_size
        if n_full == 0 or not self.may_publish:
            return True
        chain = self.keys[0].prefix_keys(namespace, tokens[:n_full * block_size], block_size)
        tail = tuple(int(t) for t in tokens[n_full * block_size:])
        blocks = _checked(blocks)
        job = lambda: self._publish_exact_now(namespace, chain, block_size, tail, blocks, manifest)  # noqa: E731
        return self._publisher.submit(job, f"publish a {len(tokens)}-token state of {namespace[:40]}")

    def _publish_exact_now(self, namespace, chain, bs, tail, blocks, manifest) -> None:
        keys = self.keys[0]
        space = self.spaces[keys.key_id]
        value = manifest()
        value = bytes(value) if isinstance(value, (bytearray, memoryview)) else value
        head = Value(block_name(value), len(value), lambda: value)
        failure = self._upload(list(blocks) + [head])
        if failure is not None:
            raise RemoteError(f"block {failure[0][:16]}: {failure[1]}; the state was not published")
        now = self._now()
        markers, digest = [], b""
        for i, k in enumerate(chain):
            digest = names_digest(digest, None)
            markers.append((space.record(k), seal_chain(k, RemoteRecord(i, i * bs, (i + 1) * bs, None, namespace),
                                                        None, keys, now, self.signer, digest)))
        self._set_records(markers, only_new=True)
        rec = ExactRecord(len(chain) - 1, tail, head.name, head.size, head.size + sum(b.size for b in blocks),
                          namespace, keys.key_id, int(now))
        # Keep the other states under this key (a prompt's boundary, the end of its answer): read,
        # merge and write back. Two publishers racing may drop one's state: a miss, nothing worse.
        key = space.exact(chain[-1])
        size, old = self._write("publish: read exact states", lambda p: (p.strlen(key), p.getrange(
            key, 0, MAX_RECORD_BYTES - 1)), check=False)
        found, _ = (unseal(EXACT, chain[-1], old, keys, now=now, writers=self.writers) if size == len(old or b"")
                    else (None, None))
        me = "" if self.signer is None else self.signer.id.hex()
        kept = [x for x in (found.states if found is not None and found.namespace == namespace else ())
                if x.tail != tail and x.writer == me]  # only this writer's own: it never re-signs another's
        self._set_records([(key, seal_exact(chain[-1], [rec] + kept, keys, now, self.signer))])

    def publish_object(self, namespace: str, values: Sequence[Value], manifest: Value) -> bool:
        """Queue publication of an exact tensor object: its chunks, then its manifest (which names
        them), then its record under the namespace's root key (cache/objects/remote.py)."""
        if not self.may_publish:
            return True
        values = _checked(list(values) + [manifest])
        job = lambda: self._publish_object_now(namespace, values, manifest)  # noqa: E731
        return self._publisher.submit(job, f"publish object {namespace[:40]}")

    def _publish_object_now(self, namespace: str, values: list, manifest: Value) -> None:
        keys = self.keys[0]
        failure = self._upload(values)
        if failure is not None:
            raise RemoteError(f"block {failure[0][:16]}: {failure[1]}; the object was not published")
        now, root = time.time(), keys.root(namespace)
        rec = ObjectRecord(manifest.name, manifest.size, sum(v.size for v in values), namespace)
        self._set_records([(self.spaces[keys.key_id].object(root), seal_object(root, rec, keys, now, self.signer))])

    def _now(self) -> float:
        """The issue time of a new record: after this writer's last tombstone (a record issued in the
        second of a removal would be removed with it)."""
        return max(time.time(), self._removed + 1)

    def _upload(self, values: list[Value]) -> tuple[str, str] | None:
        """SET the values the remote lacks (or holds at a wrong size), in byte-bounded pipelines;
        (name, why) of the first one that could not be read locally."""
        space = self.spaces[self.keys[0].key_id]
        unique = list({v.name: v for v in values}.values())  # stored encrypted: AEAD_OVERHEAD bytes longer
        present: set[str] = set()
        for chunk in _chunks(unique, META_BATCH):
            replies = self._write("publish: check blocks", lambda p, c=chunk: [
                (p.strlen(space.block(v.name)), p.expire(space.block(v.name), self.ttl_s)) for v in c], check=False)
            for v, size, refreshed in zip(chunk, replies[0::2], replies[1::2]):
                if isinstance(refreshed, Exception):
                    raise RemoteError(f"publish: check blocks: {self._describe(refreshed)}")
                if size == v.size + AEAD_OVERHEAD:
                    present.add(v.name)
        self.count(blocks_skipped=len(present))
        batch, size = [], 0
        for v in unique:
            if v.name in present:
                continue
            try:
                data = v.fetch()
                data = bytes(data) if isinstance(data, (bytearray, memoryview)) else data
            except Exception as e:  # noqa: BLE001 - the local copy went away: publish what came before it
                return v.name, f"could not be read for upload ({self._describe(e)})"
            if not isinstance(data, bytes) or len(data) != v.size or block_name(data) != v.name:
                return v.name, "its bytes do not hash to its name, not uploaded"
            batch.append((v.name, data))
            size += len(data)
            if size >= UPLOAD_BATCH_BYTES:
                self._set_values(batch)
                batch, size = [], 0
        if batch:
            self._set_values(batch)
        return None

    def _set_values(self, batch: list[tuple[str, bytes]]) -> None:
        keys = self.keys[0]
        space = self.spaces[keys.key_id]
        sealed = [(k, keys.encrypt(k.encode(), v)) for k, v in ((space.block(n), v) for n, v in batch)]
        n_bytes = sum(len(v) for _, v in sealed)
        self._write("publish: upload blocks", lambda p: [p.set(k, v, ex=self.ttl_s) for k, v in sealed], n_bytes)
        self.count(blocks_uploaded=len(batch), bytes_written=n_bytes)

    def _set_records(self, values: list[tuple[str, bytes]], only_new: bool = False) -> None:
        for chunk in _chunks(values, META_BATCH):
            self._write("publish: write records", lambda p, c=chunk: [
                p.set(k, x, ex=self.ttl_s, nx=only_new) for k, x in c], sum(len(x) for _, x in chunk))
            self.count(records_written=len(chunk), bytes_written=sum(len(x) for _, x in chunk))

    def _write(self, what: str, fill: Callable, n_bytes: int = 0, check: bool = True) -> list:
        replies = self.writer.pipeline(what, fill, 4 * self.timeout_s + n_bytes / MIN_UPLOAD_BYTES_PER_S)
        bad = next((r for r in replies if isinstance(r, Exception)), None) if check else None
        if bad is not None:
            raise RemoteError(f"{what}: {self._describe(bad)}")
        return replies

    # --- best effort, after reads ---

    def touch(self, key_id: str, chain: Sequence[bytes], exact: bytes | None, names: Sequence[str],
              converted: bool = False, layout_id: bytes | None = None) -> None:
        """Queue an EXPIRE of what a hit used: its records (of the converted chain), their layout and
        values live another TTL."""
        space = self.spaces.get(key_id)
        if space is not None:
            where = space.converted if converted else space.record
            self._best_effort("expire", [where(k) for k in chain] + ([space.exact(exact)] if exact else [])
                              + ([space.layout(layout_id)] if layout_id else []) + [space.block(n) for n in names])

    def remove_bad(self, keys: list[str]) -> None:
        """Queue an UNLINK of values that failed verification: the next publisher uploads them again."""
        self._best_effort("unlink", keys)

    def _best_effort(self, command: str, keys: list[str]) -> None:
        if command in self._denied or not keys:
            return

        def job():
            args = (self.ttl_s,) if command == "expire" else ()
            try:
                replies = self.writer.pipeline(f"{command} (best effort)", lambda p: [
                    getattr(p, command)(k, *args) for k in keys], 4 * self.timeout_s)
            except RemoteError:
                return  # counted by the client; a refresh is not worth a reported failure
            if any(_denied(r) for r in replies):
                self._denied.add(command)

        self._publisher.submit(job, f"{command} {len(keys)} keys", report=False)

    # --- deletion ---

    def remove(self, namespace: str, tokens: Sequence[int], block_size: int) -> int:
        """Leave a signed tombstone at every prefix key of `tokens` (records there issued until now are
        misses, even written back), then UNLINK the records; the number unlinked. Blocks stay (other
        prefixes may name them; their TTL ends them). A tombstone lives as long as what it outranks."""
        keys = self.keys[0]
        space = self.spaces[keys.key_id]
        chain = keys.prefix_keys(namespace, tokens, block_size)
        now, ttl = time.time(), int(max(self.ttl_s, self.max_age_s) + MAX_SKEW_S)
        self._removed = int(now)
        if self.may_publish:  # a member outside the allow-list could only write tombstones nobody reads
            tombs = [(space.tomb(k), seal_tomb(k, i, namespace, keys, now, self.signer)) for i, k in enumerate(chain)]
            for chunk in _chunks(tombs, META_BATCH):
                self._write("remove: write tombstones", lambda p, c=chunk: [p.set(k, x, ex=ttl) for k, x in c])
        return self._unlink([where(k) for where in (space.record, space.converted, space.exact) for k in chain])

    def remove_blocks(self, names: Sequence[str]) -> int:
        if not all(is_block_name(n) for n in names):
            raise ValueError("remove_blocks takes 64-hex BLAKE3 block names")
        return self._unlink([self.spaces[self.keys[0].key_id].block(n) for n in names])

    def _unlink(self, keys: list[str]) -> int:
        # One UNLINK per key: a multi-key UNLINK spanning slots is refused by a cluster.
        return sum(sum(self._write("unlink", lambda p, c=c: [p.unlink(k) for k in c])) for c in _chunks(keys, META_BATCH))

    # --- waiting ---

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait for queued publications; return the failures since the last wait (redacted strings)."""
        return self._publisher.wait(timeout)

    def close_publisher(self, timeout: float | None) -> list[str]:
        return self._publisher.close(timeout)

    def publication_stats(self) -> dict:
        return {"publish_pending": self._publisher.pending(), "publish_failed": self._publisher.failed_total,
                "reader_writes_denied": sorted(self._denied)}


def _checked(blocks: Sequence[Value]) -> list[Value]:
    out = list(blocks)
    for v in out:
        if not (isinstance(v, Value) and is_block_name(v.name) and isinstance(v.size, int) and v.size > 0
                and callable(v.fetch)):
            raise ValueError(f"each block must be a Value(64-hex BLAKE3 name, size > 0, getter), got {v!r:.80}")
    return out
