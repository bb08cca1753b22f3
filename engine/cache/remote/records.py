"""Prefix records: what a prefix key points at, sealed with a keyed BLAKE3 MAC.

    value = b"MXR1" || tag (32 bytes) || JSON body
    tag   = BLAKE3-keyed(mac_key, prefix key || body)

The body names the block holding this span of KV, the span, the namespace
and the engine's small layout JSON (opaque here). The tag covers the prefix
key too, so a record copied to another prefix's key fails: otherwise anyone
able to write to the server could make a prompt load another prompt's KV.
The MAC key is derived from the team secret; without a secret the tag is an
unkeyed BLAKE3, which catches damage but not forgery (a remote only trusted
users can write to). Blocks need no MAC: their name is their hash, and a
record that passed its MAC chose the name.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field

import blake3

from .keys import is_block_name

MAGIC = b"MXR1"
TAG_BYTES = 32
MAX_LAYOUT_BYTES = 64 * 1024
_MAC_CONTEXT = "mlxcache-kernel 2026-12 remote prefix record MAC v1"


@dataclass(frozen=True)
class RemoteRecord:
    index: int  # the block's position: it covers tokens [start, end)
    start: int
    end: int
    block: str  # the block's name (BLAKE3 hex of its value)
    namespace: str
    layout: dict = field(default_factory=dict, compare=False)


def mac_key(secret: bytes | None) -> bytes | None:
    """The 32-byte MAC key derived from the team secret (None: unkeyed tags)."""
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise ValueError("the remote secret must be at least 16 bytes (bytes, not str)")
    return blake3.blake3(bytes(secret), derive_key_context=_MAC_CONTEXT).digest()


def encode_layout(layout: dict) -> str:
    """The layout as compact JSON, checked now so a bad one fails in the caller, not the publisher."""
    if not isinstance(layout, dict):
        raise TypeError(f"layout must be a dict, got {type(layout).__name__}")
    text = json.dumps(layout, sort_keys=True, separators=(",", ":"), allow_nan=False)
    if len(text) > MAX_LAYOUT_BYTES:
        raise ValueError(f"layout JSON is {len(text)} bytes; the limit is {MAX_LAYOUT_BYTES}")
    return text


def _tag(prefix_key: bytes, body: bytes, key: bytes | None) -> bytes:
    data = prefix_key + body
    return blake3.blake3(data, key=key).digest() if key is not None else blake3.blake3(data).digest()


def seal(prefix_key: bytes, rec: RemoteRecord, layout_json: str, key: bytes | None) -> bytes:
    body = (f'{{"v":1,"index":{rec.index},"start":{rec.start},"end":{rec.end},'
            f'"block":{json.dumps(rec.block)},"namespace":{json.dumps(rec.namespace)},'
            f'"layout":{layout_json}}}').encode()
    return MAGIC + _tag(prefix_key, body, key) + body


def unseal(prefix_key: bytes, value: bytes, key: bytes | None) -> RemoteRecord | None:
    """The record, or None if its tag does not verify under `key` or its body is malformed."""
    if not isinstance(value, bytes) or len(value) <= len(MAGIC) + TAG_BYTES or not value.startswith(MAGIC):
        return None
    tag, body = value[len(MAGIC):len(MAGIC) + TAG_BYTES], value[len(MAGIC) + TAG_BYTES:]
    if not hmac.compare_digest(tag, _tag(prefix_key, body, key)):
        return None
    try:
        d = json.loads(body)
        rec = RemoteRecord(int(d["index"]), int(d["start"]), int(d["end"]), d["block"], d["namespace"],
                           d["layout"])
    except (ValueError, KeyError, TypeError):
        return None
    if d.get("v") != 1 or not is_block_name(rec.block) or not isinstance(rec.layout, dict):
        return None
    return rec
