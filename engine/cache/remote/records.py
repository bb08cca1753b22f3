"""Prefix records: what a prefix key points at, encrypted and authenticated under the team secret.

    value = b"MXR4" || nonce (12) || AES-256-GCM(writer id (8) || signature (64) || body) || GCM tag (16)
            the associated data is the kind and the prefix key (TeamKeys.encrypt): a server
            reader sees neither the block names (BLAKE3 content names, which anyone
            running the same public model on a guessed prompt could compute) nor the
            namespace, tokens or times; the tag says a holder of the secret sealed it
    signature = Ed25519 by the writer (writers.py) of what the record says:
            a chain record i signs its prefix key, the digest of the block
            names 0..i (`names_digest`: so one signature vouches for the
            whole run a lookup uses, and a lookup verifies one) and its head
            (with its layout's id); an exact or object record signs its kind,
            key and body. A writer without a signing key writes zeros, which only a
            reader without an allow-list accepts.

Three kinds hang from a prefix key (the chain key of full blocks 0..i):

- a chain record (kind "c"): block i's name and the id of its publication's
  layout (the engine's layout JSON, which says how to rebuild the first i+1
  blocks of KV), with the layout's minimum reusable offset. A lookup reads
  one per block (255 at 8k tokens), so its body is packed binary
  (CHAIN_HEAD, then the namespace): parsing it costs a microsecond where
  JSON cost a hundred. The layout (~3 KB for a 30-layer model) is stored
  once per publication (`seal_layout`, under KeySpace.layout of its keyed
  id, TeamKeys.layout_id), not in each record: a lookup reads ~100 bytes a
  block instead of ~3 KB, and the one layout it ends on in the round trip
  it makes anyway for tombstones (tier.py). A layout value is encrypted like
  a record, bound to its id as associated data, and opens only if its
  plaintext hashes to that id, which the record's signature covers. A chain
  record without a layout is a marker: the prefix continues (towards an
  exact record), but its blocks alone are no usable state.
- a converted chain record (kind "q"): the same, for a checkpoint that
  serves only lengths from its layout's `min_reusable_offset` on (KV
  quantized at kv_start: its blocks before the start are quantized too, so
  they are not the full-precision blocks a shorter prompt's chain holds).
  It is a chain of its own beside the plain one, at the same prefix keys.
- an exact record (kind "x"): up to MAX_EXACT_STATES whole checkpoints
  whose state is exact only at its own length (recurrent, a wrapped ring),
  each the prefix's full blocks plus `tail`, the few tokens after them, and
  the manifest that holds the inline state and names its blocks (a prompt's
  boundary and the end of its answer often share their full blocks), as
  JSON: few are read.

A third kind hangs from a namespace's root key instead: an object record
(kind "o", JSON) names the manifest of an exact tensor object
(Engine.objects; the namespace holds its key digest; cache/objects/remote.py).
A fourth, a tombstone (kind "t", JSON, at its own key), is what remove()
leaves: records at its prefix key issued no later than it are misses.

Every body carries the key id of the secret that sealed it (rotation) and
its issue time: a record older than `max_age_s` (7 days), or issued more
than MAX_SKEW_S (5 minutes) ahead of this clock, is stale. The associated data covers the kind and the prefix key,
so a record copied to another key fails: otherwise anyone able to write to
the server could make a prompt load another prompt's KV.

`unseal` is the only parser of what the server returns, and it never
raises: anything but a well-formed, verified, fresh record of the expected
kind is (None, reason). Nothing here is parsed before its size is bounded
(the caller reads at most MAX_RECORD_BYTES).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import blake3

from .keys import AEAD_OVERHEAD, REMOTE_FORMAT, TeamKeys, is_block_name
from .writers import NO_SIGNATURE, NO_WRITER, SIG_BYTES, WRITER_ID_BYTES, SigningKey, Writers

MAGIC = b"MXR4"
SIGNED = WRITER_ID_BYTES + SIG_BYTES  # writer id and signature, after the tag
MAX_RECORD_BYTES = 64 * 1024  # a value this long or longer at a record key is not read (nor more of it)
MAX_LAYOUT_BYTES = MAX_RECORD_BYTES - 1024
MAX_AGE_S = 7 * 24 * 3600  # a record must be republished (re-sealed) within this (the values' TTL)
MAX_SKEW_S = 5 * 60  # clocks disagree by minutes; a record further in the future is refused
MAX_VALUE_BYTES = 1 << 30  # no block or manifest is larger
MAX_EXACT_STATES = 8  # exact states kept under one prefix key, newest first
CHAIN, CONVERTED, EXACT, OBJECT, TOMB, LAYOUT = "c", "q", "x", "o", "t", "l"
# version, flags (1: a block, 2: a layout), key id, issued, index, start, end, minimum reusable offset,
# block digest, layout id, namespace length
CHAIN_HEAD = struct.Struct("<BB6sQIIII32s32sH")
LAYOUT_MAGIC = b"MXL1"
_MAX_INDEX = 1 << 24
_INT32_MAX = 2**31 - 1
_UINT32_MAX = 2**32 - 1


class RemoteRecord(NamedTuple):  # a tuple: a probe makes hundreds, a frozen dataclass is 3x slower to build
    """A chain record: block `index` of a prefix covers tokens [start, end)."""

    index: int
    start: int
    end: int
    block: str | None  # the block's name (BLAKE3 hex of its value); None in a marker without blocks
    namespace: str
    layout_id: bytes | None = None  # the id of its layout (TeamKeys.layout_id); None: a marker (the prefix continues)
    key_id: str = ""
    issued: int = 0
    writer: bytes = NO_WRITER  # the signer's id (writers.py)
    signature: bytes = NO_SIGNATURE
    head: bytes = b""  # the packed head and namespace as read: what the signature covers
    min_offset: int = 0  # its layout's minimum reusable offset (converted KV: the shortest length it serves)


def names_digest(previous: bytes, block: str | None) -> bytes:
    """The running digest of a prefix's block names: names_digest(d(0..i-1), name i) = d(0..i); start from b""."""
    return blake3.blake3(previous + (bytes.fromhex(block) if block else bytes(32))).digest()


def _chain_signed(prefix_key: bytes, digest: bytes, writer: bytes, head: bytes) -> bytes:
    return b"mlxcache chain signature" + prefix_key + digest + writer + head


def chain_signature(prefix_key: bytes, rec: "RemoteRecord", digest: bytes, writers: Writers) -> str | None:
    """None if chain record `rec` (at `prefix_key`, with block names digest `digest` of 0..rec.index)
    is signed by an allow-listed writer; else why not ("unknown_writer" / "signature")."""
    return writers.verify(rec.writer, rec.signature, _chain_signed(prefix_key, digest, rec.writer, rec.head))


@dataclass(frozen=True)
class ExactRecord:
    """A whole checkpoint of (index + 1) full blocks plus `tail`, held by `manifest`."""

    index: int
    tail: tuple
    manifest: str  # BLAKE3 hex of the manifest value
    size: int  # the manifest's bytes
    nbytes: int  # the manifest and every block it names: what a fetch reads
    namespace: str
    key_id: str = ""
    issued: int = 0
    writer: str = ""  # hex id of the writer that signed the record holding it ("" unsigned)

    def length(self, block_size: int) -> int:
        return (self.index + 1) * block_size + len(self.tail)


@dataclass(frozen=True)
class ExactSet:
    """The exact states under one prefix key (kind "x"), newest first."""

    index: int
    namespace: str
    states: tuple  # of ExactRecord
    key_id: str = ""
    issued: int = 0
    writer: str = ""


@dataclass(frozen=True)
class ObjectRecord:
    """An exact tensor object (kind "o", under its namespace's root key): its manifest value names
    its chunks (engine/cache/objects/remote.py)."""

    manifest: str  # BLAKE3 hex of the manifest value
    size: int  # the manifest's bytes
    nbytes: int  # the manifest and every chunk it names: what a fetch reads
    namespace: str
    key_id: str = ""
    issued: int = 0
    writer: str = ""


@dataclass(frozen=True)
class Tombstone:
    """A signed removal at a prefix key (kind "t", its own key): every chain or exact record at that
    key issued at or before `issued` is a miss, so writing captured values back does not undo it."""

    index: int
    namespace: str
    key_id: str = ""
    issued: int = 0
    writer: str = ""


def encode_layout(layout: dict) -> str:
    """The layout as compact JSON, checked now so a bad one fails in the caller, not the publisher."""
    if not isinstance(layout, dict):
        raise TypeError(f"layout must be a dict, got {type(layout).__name__}")
    text = json.dumps(layout, sort_keys=True, separators=(",", ":"), allow_nan=False)
    if len(text) > MAX_LAYOUT_BYTES:
        raise ValueError(f"layout JSON is {len(text)} bytes; the limit is {MAX_LAYOUT_BYTES}")
    return text


def min_reusable_offset(layout: bytes | None) -> int:
    """The minimum reusable offset a chain record's layout JSON states (0: none); an unreadable
    layout serves no length (rebuild.parse_layout checks the whole layout before use)."""
    try:
        v = json.loads(layout, parse_float=_no_floats, parse_constant=_no_floats).get("min_reusable_offset", 0)
    except Exception:  # noqa: BLE001 - verified bytes from another build: no usable length
        return 1 << 62
    return v if type(v) is int and 0 <= v < 2**31 else 1 << 62


def _ad(kind: str, prefix_key: bytes) -> bytes:
    """What a record's AEAD binds in: its kind and key (copied to another key, it does not open)."""
    return b"mlxcache record " + kind.encode() + prefix_key


def _signed_part(signer: SigningKey | None, data: bytes) -> bytes:
    return NO_WRITER + NO_SIGNATURE if signer is None else signer.id + signer.sign(signer.id + data)


def _record_signed(kind: str, prefix_key: bytes, body: bytes) -> bytes:
    return b"mlxcache record signature" + kind.encode() + prefix_key + body


_last_layout: tuple = (b"", None, 0, b"")


def _layout_facts(layout: bytes, keys: TeamKeys) -> tuple[int, bytes]:
    """(min_reusable_offset as a record's uint32, layout id) of a layout being sealed; the last one is
    remembered (a publication seals the same layout in each of its records). The tuple is replaced
    whole, so threads sharing it see one or the other."""
    global _last_layout
    last = _last_layout
    if layout != last[0] or keys is not last[1]:
        last = _last_layout = (layout, keys, min(min_reusable_offset(layout), _UINT32_MAX), keys.layout_id(layout))
    return last[2], last[3]


def _seal(kind: str, prefix_key: bytes, fields: dict, keys: TeamKeys, now: float, signer: SigningKey | None) -> bytes:
    doc = {"v": REMOTE_FORMAT, "t": kind, "kid": keys.key_id, "iat": int(now), **fields}
    body = json.dumps(doc, separators=(",", ":")).encode()
    body = _signed_part(signer, _record_signed(kind, prefix_key, body)) + body
    return MAGIC + keys.encrypt(_ad(kind, prefix_key), body)


def seal_chain(prefix_key: bytes, rec: RemoteRecord, layout_json: str | None, keys: TeamKeys, now: float,
               signer: SigningKey | None = None, digest: bytes = b"", kind: str = CHAIN) -> bytes:
    """`layout_json`: the publication's layout (stored apart: seal_layout), None for a marker.
    `digest`: names_digest of the block names 0..rec.index (what the signature vouches for).
    kind CONVERTED: a record of the converted chain (its layout has a minimum reusable offset)."""
    ns = rec.namespace.encode()
    flags = (rec.block is not None) | (layout_json is not None) << 1
    offset, layout_id = (0, bytes(32)) if layout_json is None else _layout_facts(layout_json.encode(), keys)
    head = CHAIN_HEAD.pack(REMOTE_FORMAT, flags, keys.key_id_bytes, int(now), rec.index, rec.start, rec.end, offset,
                           bytes.fromhex(rec.block) if rec.block else bytes(32), layout_id, len(ns)) + ns
    if signer is None:
        signed = NO_WRITER + NO_SIGNATURE
    else:
        signed = signer.id + signer.sign(_chain_signed(prefix_key, digest, signer.id, head))
    return MAGIC + keys.encrypt(_ad(kind, prefix_key), signed + head)


def seal_layout(layout_json: str, keys: TeamKeys) -> tuple[bytes, bytes]:
    """(its id, its value): a publication's layout, stored once under KeySpace.layout(id)."""
    layout = layout_json.encode()
    layout_id = keys.layout_id(layout)
    return layout_id, LAYOUT_MAGIC + keys.encrypt(_ad(LAYOUT, layout_id), layout)


def open_layout(layout_id: bytes, value, keys: TeamKeys) -> bytes | None:
    """The layout JSON a layout value holds, if it is the one named `layout_id` (sealed by a holder
    of the secret for this id, and hashing to it); None otherwise. Never raises."""
    if (not isinstance(value, bytes) or not len(LAYOUT_MAGIC) + AEAD_OVERHEAD < len(value) <= MAX_RECORD_BYTES
            or not value.startswith(LAYOUT_MAGIC)):
        return None
    plain = keys.decrypt(_ad(LAYOUT, layout_id), memoryview(value)[len(LAYOUT_MAGIC):])
    return plain if plain is not None and keys.layout_id(plain) == layout_id else None


def seal_exact(prefix_key: bytes, states: Sequence[ExactRecord], keys: TeamKeys, now: float,
               signer: SigningKey | None = None) -> bytes:
    """Up to MAX_EXACT_STATES states of one prefix key (the same index and namespace), newest first."""
    states = list(states)[:MAX_EXACT_STATES]
    fields = {"ns": states[0].namespace, "i": states[0].index, "states": [
        {"tail": list(x.tail), "manifest": x.manifest, "size": x.size, "bytes": x.nbytes,
         "iat": x.issued or int(now)} for x in states]}
    return _seal(EXACT, prefix_key, fields, keys, now, signer)


def seal_object(root_key: bytes, rec: ObjectRecord, keys: TeamKeys, now: float,
                signer: SigningKey | None = None) -> bytes:
    fields = {"ns": rec.namespace, "i": 0, "manifest": rec.manifest, "size": rec.size, "bytes": rec.nbytes}
    return _seal(OBJECT, root_key, fields, keys, now, signer)


def seal_tomb(prefix_key: bytes, index: int, namespace: str, keys: TeamKeys, now: float,
              signer: SigningKey | None = None) -> bytes:
    return _seal(TOMB, prefix_key, {"ns": namespace, "i": index}, keys, now, signer)


def _no_floats(text):
    raise ValueError(f"no floats or constants in a record: {text[:20]!r}")


def _int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def unseal(kind: str, prefix_key: bytes, value, keys: TeamKeys, *, now: float, max_age_s: float = MAX_AGE_S,
           writers: Writers | None = None) -> tuple[RemoteRecord | ExactSet | ObjectRecord | Tombstone | None,
                                                    str | None]:
    """(record, None), or (None, why): "mac" (not sealed by this secret for this key and kind),
    "malformed" (verified but not a record this build reads), "stale" (too old, or from the future),
    or, with an allow-list `writers`, "unknown_writer" / "signature" (an exact or object record not
    signed by a listed writer; a chain record's signature is checked over its run: chain_signature)."""
    if not isinstance(value, bytes) or not len(MAGIC) + AEAD_OVERHEAD + SIGNED < len(value) <= MAX_RECORD_BYTES \
            or not value.startswith(MAGIC):
        return None, "malformed"
    plain = keys.decrypt(_ad(kind, prefix_key), memoryview(value)[len(MAGIC):])
    if plain is None:
        return None, "mac"
    if kind in (CHAIN, CONVERTED):
        return _unseal_chain(plain, keys, now, max_age_s)
    writer, signature, body = plain[:WRITER_ID_BYTES], plain[WRITER_ID_BYTES:SIGNED], plain[SIGNED:]
    if writers:
        why = writers.verify(writer, signature, writer + _record_signed(kind, prefix_key, body))
        if why is not None:
            return None, why
    try:  # deep nesting (RecursionError), huge integers, bad UTF-8: a miss like any other malformed body
        d = json.loads(body, parse_float=_no_floats, parse_constant=_no_floats)
        rec = (_parse_object if kind == OBJECT else _parse_tomb if kind == TOMB else _parse_exact)(d, keys, writer)
    except Exception:  # noqa: BLE001 - a verified body from another build is still only a miss
        return None, "malformed"
    if rec is None:
        return None, "malformed"
    if not now - max_age_s <= rec.issued <= now + MAX_SKEW_S:
        return None, "stale"
    if kind in (OBJECT, TOMB):
        return rec, None
    return dataclasses.replace(rec, states=tuple(x for x in rec.states if now - max_age_s <= x.issued)), None


def _unseal_chain(plain: bytes, keys: TeamKeys, now: float, max_age_s: float):
    """unseal() of a decrypted chain record: its head unpacked once (a probe does hundreds)."""
    if len(plain) < SIGNED + CHAIN_HEAD.size:
        return None, "malformed"
    v, flags, kid, issued, index, start, end, offset, block, layout_id, ns_len = CHAIN_HEAD.unpack_from(plain, SIGNED)
    at = SIGNED + CHAIN_HEAD.size + ns_len
    if (v != REMOTE_FORMAT or flags > 3 or kid != keys.key_id_bytes or index > _MAX_INDEX or not start < end
            or not 0 < ns_len <= 1024 or len(plain) != at or (offset and not flags & 2)):
        return None, "malformed"
    try:
        namespace = plain[SIGNED + CHAIN_HEAD.size:at].decode()
    except UnicodeDecodeError:
        return None, "malformed"
    if not now - max_age_s <= issued <= now + MAX_SKEW_S:
        return None, "stale"
    return RemoteRecord(index, start, end, block.hex() if flags & 1 else None, namespace,
                        layout_id if flags & 2 else None, keys.key_id, issued, plain[:WRITER_ID_BYTES],
                        plain[WRITER_ID_BYTES:SIGNED], plain[SIGNED:at], offset), None


def _head_ok(kind: str, d, keys: TeamKeys) -> bool:
    return (type(d) is dict and d.get("v") == REMOTE_FORMAT and d.get("t") == kind and d.get("kid") == keys.key_id
            and _int(d.get("iat"), 0, 1 << 40) and _int(d.get("i"), 0, _MAX_INDEX)
            and type(d.get("ns")) is str and 0 < len(d["ns"]) <= 1024)


def _parse_object(d, keys: TeamKeys, writer: bytes) -> ObjectRecord | None:
    if not (_head_ok(OBJECT, d, keys) and is_block_name(d.get("manifest")) and _int(d.get("size"), 1, MAX_VALUE_BYTES)
            and _int(d.get("bytes"), d["size"], 1 << 50)):
        return None
    return ObjectRecord(d["manifest"], d["size"], d["bytes"], d["ns"], d["kid"], d["iat"], _wid(writer))


def _parse_tomb(d, keys: TeamKeys, writer: bytes) -> Tombstone | None:
    if not _head_ok(TOMB, d, keys):
        return None
    return Tombstone(d["i"], d["ns"], d["kid"], d["iat"], _wid(writer))


def _wid(writer: bytes) -> str:
    return "" if writer == NO_WRITER else writer.hex()


def _parse_exact(d, keys: TeamKeys, writer: bytes) -> ExactSet | None:
    if not _head_ok(EXACT, d, keys):
        return None
    states = d.get("states")
    if type(states) is not list or not 0 < len(states) <= MAX_EXACT_STATES:
        return None
    out = []
    for x in states:
        tail = x.get("tail") if type(x) is dict else None
        if not (type(tail) is list and len(tail) <= 4096 and all(_int(t, 0, _INT32_MAX) for t in tail)
                and is_block_name(x.get("manifest")) and _int(x.get("size"), 1, MAX_VALUE_BYTES)
                and _int(x.get("bytes"), x["size"], 1 << 50) and _int(x.get("iat"), 0, d["iat"])):
            return None
        out.append(ExactRecord(d["i"], tuple(tail), x["manifest"], x["size"], x["bytes"], d["ns"], d["kid"], x["iat"],
                               _wid(writer)))
    return ExactSet(d["i"], d["ns"], tuple(out), d["kid"], d["iat"], _wid(writer))
