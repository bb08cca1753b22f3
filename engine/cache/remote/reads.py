"""Block values read from the remote tier: sized, read, decrypted and verified, one chunk ahead.

The block-reading half of RemoteTier (tier.py). A block or manifest is read
only after STRLEN says it is exactly the size its record or layout promised,
and then with GETRANGE of that size, GET_BATCH values per round trip. Each
value is decrypted (AES-256-GCM: some holder of the secret sealed it) and
BLAKE3-checked against its name (the record, signed by its writer, names
it; any holder of the secret could seal other bytes under that key). That
is the one check of a value: rebuild.py copies what get_blocks returns
without hashing it again.

While chunk i+1 is read on the caller's thread, one worker thread decrypts
and verifies chunk i (AES-GCM, BLAKE3 and the socket reads all release the
GIL), so a hit's crypto hides behind its transfer. Where values are large
against the round trip, the last chunks halve (4, 2, 1 values): what is left
to verify after the last byte arrives is one value, not GET_BATCH (on a link
slower than the crypto, the only part of it a lookup waits for), for two or
three more round trips; and that last value, when its verification outlasts
a probe's round trip, is read in pieces (ValueInPieces: 1/2, 1/4, 1/8, 1/8), each
decrypted and hashed as it arrives. Values are still taken in
order, exactly as if read one chunk after another: the verified values
before a bad block, a read error or the deadline are what RemoteMiss carries.
"""

from __future__ import annotations

import time
from concurrent import futures
from typing import Sequence

import blake3
from cryptography.exceptions import InvalidTag

from .client import RemoteError
from .keys import AEAD_OVERHEAD, NONCE_BYTES, KeySpace, block_name, is_block_name
from .meter import PRIOR_LATENCY_S
from .records import MAX_VALUE_BYTES

PIECES = 4  # the last value of a fetch, read in up to this many ranges (1/2, 1/4, 1/8, 1/8 of it)
MIN_PIECE_BYTES = 64 * 1024
GET_BATCH = 8  # block values per round trip: at most 8 x 4 MB read while the 8 before are verified
META_BATCH = 256  # small commands (STRLEN, EXPIRE, record SET, UNLINK) per pipeline


class RemoteMiss(Exception):
    """Blocks could not be read and verified: a cache miss, never a wrong answer.

    `blocks` holds the verified values read before the miss, in order (a
    shorter prefix the caller may still use)."""

    def __init__(self, message: str, blocks: list[bytes] | None = None):
        super().__init__(message)
        self.blocks = blocks or []


class BlockReads:
    """get_blocks for RemoteTier (which provides spaces, keys, reader, meter, count and remove_bad)."""

    def __init__(self):
        self._opener = futures.ThreadPoolExecutor(1, thread_name_prefix="mlxcache-remote-verify")
        self._fetcher = futures.ThreadPoolExecutor(1, thread_name_prefix="mlxcache-remote-fetch")

    def start_blocks(self, items: Sequence[tuple[str, int]], *, key_id: str | None = None,
                     deadline: float | None = None) -> futures.Future:
        """get_blocks on the tier's fetch thread, so the caller's thread does other work meanwhile (the
        first-layer sample: ~1-1.5 ms at 8k that would delay the first read); result() returns or
        raises as get_blocks would."""
        fetch = self._fetcher.submit(self.get_blocks, items, key_id=key_id, deadline=deadline)
        time.sleep(0)  # the GIL to the fetch thread first: its first read, not the caller's work, is what a hit waits for
        return fetch

    def get_blocks(self, items: Sequence[tuple[str, int]], *, key_id: str | None = None,
                   deadline: float | None = None) -> list[bytes]:
        """The values of blocks (name, exact size), each read only if its size is right and verified
        by BLAKE3; RemoteMiss (with the verified values before it) if any is missing, wrong or unreadable.
        Each is bytes, but a value read in pieces (a fetch's last) is a bytearray: no copy of it."""
        items, out = list(items), []
        try:
            self._read_blocks(items, key_id, deadline, out)
            why = None
        except (RemoteError, RemoteMiss) as e:
            why = str(e)
        self.count(hits=len(out), misses=len(items) - len(out))
        if why is not None:
            raise RemoteMiss(why, out)
        return out

    def _read_blocks(self, items: list, key_id: str | None, deadline, out: list) -> None:
        """Append each verified value to `out`; RemoteMiss (or RemoteError) at the first that is not one."""
        space = self.spaces.get(key_id or self.keys[0].key_id)
        if space is None:
            raise RemoteMiss(f"no secret with key id {key_id!r:.20}")
        bad = next((n for n, s in items if not (is_block_name(n) and isinstance(s, int) and 0 < s <= MAX_VALUE_BYTES)),
                   None)
        if bad is not None:
            raise RemoteMiss(f"not a block name or size: {bad!r:.80}")
        sized, why = self._sized(items, space, deadline)
        opening = None  # (the chunk before, its values being opened by the worker)
        for chunk, pieces in self.read_plan(sized):
            try:
                got = self._read_piece(space, chunk[0], *pieces[0], deadline) if pieces else \
                    self._read_values(chunk, space, deadline)
            finally:  # the chunk before is kept first, even when this read failed: as if read one by one
                if opening is not None:
                    self._keep(space, *opening, out)
            if not pieces:
                opening = chunk, self._opener.submit(self._opened, space, chunk, got)
                continue
            value = ValueInPieces(space, *chunk[0])
            self._opener.submit(value.feed, got)
            for lo, hi in pieces[1:]:
                self._opener.submit(value.feed, self._read_piece(space, chunk[0], lo, hi, deadline))
            opening = chunk, self._opener.submit(value.finish)
        if opening is not None:
            self._keep(space, *opening, out)
        if why is not None:
            raise RemoteMiss(why)

    def read_plan(self, sized: list) -> list[tuple[list, list]]:
        """How get_blocks reads (name, size) items: [(chunk, pieces)], a chunk's values in one round
        trip, or one value in ranges `pieces`. GET_BATCH values a chunk; where values are large against
        the round trip, the last chunks halve (three more round trips against 7 values' verification)
        and the last value, when its verification outlasts a probe's round trip, comes in pieces."""
        largest, latency = max((s for _, s in sized), default=0), self.meter.latency_s or PRIOR_LATENCY_S
        halve = 3 * latency < self.meter.verify_seconds((GET_BATCH - 1) * largest)
        plan, first = [], 0
        for size in chunk_sizes(len(sized), halve):
            chunk, first = sized[first:first + size], first + size
            # Pieces: 3 one-command round trips, about one probe round trip (its 32 commands' client work
            # is most of it near the server), against 7/8 of the value's verification.
            last = size == 1 and first == len(sized) and latency < self.meter.verify_seconds(chunk[0][1])
            plan.append((chunk, piece_ranges(chunk[0][1]) if last else []))
        return plan

    def _keep(self, space: KeySpace, chunk: list, opened: futures.Future, out: list) -> None:
        """Append a chunk's verified values; at its first bad one count it, remove it, RemoteMiss."""
        plain = opened.result()
        out += plain
        if len(plain) < len(chunk):
            n = chunk[len(plain)][0]
            self.count(bad_blocks=1)
            self.remove_bad([space.block(n)])
            raise RemoteMiss(f"block {n[:16]} failed verification (it does not decrypt under this secret "
                             "or hash to its name); removed")

    def _sized(self, items: list, space: KeySpace, deadline) -> tuple[list, str | None]:
        """The leading items whose STRLEN is their expected size, and why the list stops where it does."""
        for first in range(0, len(items), META_BATCH):
            chunk = items[first:first + META_BATCH]
            sizes = self.reader.pipeline("read block sizes", lambda p, c=chunk: [p.strlen(space.block(n)) for n, _ in c],
                                         time_left(deadline))
            for i, ((n, want), got) in enumerate(zip(chunk, sizes), first):
                want += AEAD_OVERHEAD  # stored encrypted (TeamKeys.encrypt)
                if got == want:
                    continue
                if got == 0:
                    return items[:i], f"block {n[:16]} is not in the remote (evicted or expired)"
                self.count(wrong_size=1) if isinstance(got, int) else self.count(malformed=1)
                self.remove_bad([space.block(n)])
                return items[:i], (f"block {n[:16]} is {got} bytes, not the {want} its record says; not read, removed"
                                   if isinstance(got, int) else f"block {n[:16]} is not a string value; removed")
        return items, None

    def _read_values(self, chunk: list, space: KeySpace, deadline) -> list[bytes]:
        """A chunk's stored (encrypted) values, whole, in one round trip."""
        return self._read_ranges(space, [(n, 0, s + AEAD_OVERHEAD) for n, s in chunk], deadline)

    def _read_piece(self, space: KeySpace, item: tuple[str, int], lo: int, hi: int, deadline) -> bytes:
        """Bytes [lo, hi) of an item's stored (encrypted) value; RemoteMiss if it is gone since its STRLEN
        (evicted or expired: not counted as a bad block; anything else it became fails verification)."""
        piece, = self._read_ranges(space, [(item[0], lo, hi)], deadline)
        if piece == b"":
            raise RemoteMiss(f"block {item[0][:16]} is not in the remote (evicted or expired while read)")
        return piece

    def _read_ranges(self, space: KeySpace, ranges: list, deadline) -> list[bytes]:
        """Bytes [lo, hi) of each (name, lo, hi), one GETRANGE each in one round trip (b"" for what the
        server refused); counted and timed for the bandwidth estimate."""
        t0 = time.perf_counter()
        values = self.reader.pipeline("read blocks", lambda p: [p.getrange(space.block(n), lo, hi - 1)
                                                                 for n, lo, hi in ranges], time_left(deadline))
        values = [v if isinstance(v, bytes) else b"" for v in values]
        n_bytes = sum(len(v) for v in values)
        self.count(bytes_read=n_bytes)
        self.meter.transfer(n_bytes, time.perf_counter() - t0)
        return values

    def _opened(self, space: KeySpace, chunk: list, values: list) -> list[bytes]:
        """The plaintexts of a chunk's values up to the first that does not decrypt to its size and
        name (on the opener thread, timed: read_plan weighs round trips against it)."""
        t0, out = time.perf_counter(), []
        for (n, size), v in zip(chunk, values):
            v = space.keys.decrypt(space.block(n).encode(), v)  # one AEAD call per value
            if v is None or len(v) != size or block_name(v) != n:
                break
            out.append(v)
        self.meter.verified(sum(map(len, out)), time.perf_counter() - t0)
        return out

    def close_reads(self) -> None:
        self._fetcher.shutdown(cancel_futures=True)
        self._opener.shutdown(cancel_futures=True)




class ValueInPieces:
    """One value opened as its pieces arrive, in order, on the opener thread: decrypted (AES-GCM)
    into its buffer and hashed piece by piece, so what is left when its last byte arrives is
    the last piece's work. finish() returns [the value] only if the GCM tag authenticates all of
    it and its BLAKE3 is its name; nothing unauthenticated leaves this object."""

    def __init__(self, space: KeySpace, name: str, size: int):
        self.keys, self.ad, self.name, self.size = space.keys, space.block(name).encode(), name, size
        self.buf = bytearray(size + 16)  # update_into needs a block's room beyond what it writes
        self.at, self.decryptor, self.tag = 0, None, b""
        self.hasher = blake3.blake3()

    def feed(self, piece: bytes) -> None:
        """The next piece of the stored value (nonce, ciphertext, tag), in order."""
        view = memoryview(piece)
        if self.decryptor is None:
            if len(view) < NONCE_BYTES:  # gone or replaced since its STRLEN (GCM takes no such nonce)
                return  # finish() finds it short
            self.decryptor, view = self.keys.decryptor(self.ad, bytes(view[:NONCE_BYTES])), view[NONCE_BYTES:]
        end = self.size - self.at  # ciphertext bytes still to come; the tag follows them
        data, self.tag = view[:end], bytes(view[end:])
        with memoryview(self.buf) as out:  # (released before finish() trims the buffer)
            n = self.decryptor.update_into(data, out[self.at:])
            self.hasher.update(out[self.at:self.at + n])
        self.at += n

    def finish(self) -> list:
        if self.decryptor is None or self.at != self.size or len(self.tag) != 16:
            return []
        try:
            self.decryptor.finalize_with_tag(self.tag)
        except InvalidTag:
            return []
        if self.hasher.hexdigest() != self.name:
            return []
        del self.buf[self.size:]
        return [self.buf]


def piece_ranges(size: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of a value of `size` plaintext bytes as stored (AEAD_OVERHEAD more): halves,
    1/2, 1/4, 1/8, 1/8 of it, none under MIN_PIECE_BYTES; [] for a value too small to split."""
    total, out, lo = size + AEAD_OVERHEAD, [], 0
    while len(out) < PIECES - 1 and (total - lo) // 2 >= MIN_PIECE_BYTES:
        out.append((lo, lo + (total - lo) // 2))
        lo = out[-1][1]
    return out + [(lo, total)] if out else []


def chunk_sizes(n: int, halve: bool = True) -> list[int]:
    """Values per read for n values: GET_BATCH at a time; with `halve` the last reads 4, 2, 1
    (fewer when n is small), so the verification still to do when the transfer ends is one value's."""
    tail, size = [], 1
    while halve and n > 0 and size < GET_BATCH:
        tail.append(min(size, n))
        n, size = n - tail[-1], size * 2
    return [n % GET_BATCH] * bool(n % GET_BATCH) + [GET_BATCH] * (n // GET_BATCH) + tail[::-1]


def time_left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()
