"""Exact tensor objects on the remote tier (Redis / Valkey), beside prefixes.

    <prefix>:<key id>:obj:<keyed root of the object's namespace>   a sealed object record (cache/remote/records.py)
    <prefix>:<key id>:blk:<keyed id>                                 its manifest, then its chunks

An object's SSD file holds each array's bytes in 4 MiB chunks, each with
its BLAKE3 (cache.py). Publication (the writer thread, after the local
commit) uploads every chunk as a remote value named by that digest, then a
small JSON manifest (the object revision, key digest, label, the value's
tree, and per chunk its name and size; itself a value named by its BLAKE3),
then the record, sealed with the team secret, which names the manifest.
Values go before what names them; chunks another object or publication
stored already are not sent again.

A lookup that misses RAM and SSD (`fetch`, owner thread) reads the record
(bounded, decrypted and authenticated), the manifest (size-checked, verified, then parsed
and checked whole: it must be this key's, in this revision, its chunks
exactly covering its arrays), then the chunks, each verified against its
name and copied straight into the MLX buffer of its array. Anything wrong is
a miss (RemoteMiss or None), never an exception in the caller's cell. The
caller adopts the object in RAM and writes it through to the local SSD.
"""

from __future__ import annotations

import json
import os
import time

import blake3
import mlx.core as mx
import numpy as np

from ..remote.publish import Value
from ..remote.records import MAX_VALUE_BYTES
from ..remote.tier import RemoteMiss, RemoteTier
from ..ssd import format as fmt
from .values import leaf_nbytes, leaf_specs, stored_leaf

MANIFEST_MAX = 16 << 20  # an object manifest (its tree and chunk list) is never larger
DEADLINE_S = 2.0  # a fetch may take this long, plus its bytes at MIN_BYTES_PER_S
MIN_BYTES_PER_S = 20 << 20


def publish(tier: RemoteTier, info: fmt.FileInfo, revision: int) -> bool:
    """Queue the committed object file `info` for the remote (writer thread); False if not queued."""
    h = info.header
    if h.identity.get("object") != revision or len(h.layout) != 1 or h.span_tensors:
        return False
    chunks, values = [], []
    for t in h.tensors:
        if t.codec != "raw" or t.raw_bytes <= 0:
            return False
        chunks.append([t.name, t.digest, t.raw_bytes])
        values.append(Value(t.digest, t.raw_bytes, lambda t=t: _read_range(info.path, t.offset, t.raw_bytes)))
    doc = {"object": revision, "key": h.identity.get("key"), "label": h.identity.get("label", ""),
           "tree": h.layout[0].get("tree"), "chunks": chunks}
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if len(body) > MANIFEST_MAX:
        return False
    manifest = Value(blake3.blake3(body).hexdigest(), len(body), lambda: body)
    return tier.publish_object(h.namespace, values, manifest)


def _read_range(path, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, size, offset)
    finally:
        os.close(fd)
    return data  # publication checks it hashes to its name before sending it


def fetch(tier: RemoteTier, namespace: str, key_digest: str, revision: int):
    """(tree, leaves, label, record) of the object in `namespace`, read and verified from the remote
    (the record says its writer and key id: its origin); None when the remote has no usable record,
    RemoteMiss when a read fails or does not verify."""
    if tier.breaker.is_open():
        return None
    deadline = time.monotonic() + DEADLINE_S
    rec = tier.find_object(namespace, deadline=deadline)
    if rec is None or rec.size > MANIFEST_MAX:
        return None
    deadline += rec.nbytes / MIN_BYTES_PER_S
    body, = tier.get_blocks([(rec.manifest, rec.size)], key_id=rec.key_id, deadline=deadline)
    plan = _plan(body, key_digest, revision, rec.nbytes - rec.size)
    if plan is None:
        tier.count(malformed=1)
        raise RemoteMiss("a remote object manifest this build cannot use")
    tree, specs, chunks, label = plan
    buffers = [mx.empty((leaf_nbytes(*s),), dtype=mx.uint8) for s in specs]
    mx.eval(buffers)
    views = [np.asarray(b) for b in buffers]
    items = [(name, size) for _, _, name, size in chunks]
    for i in range(0, len(items), 8):  # eight chunks in flight at most
        for (leaf, lo, _, size), value in zip(chunks[i:i + 8], tier.get_blocks(
                items[i:i + 8], key_id=rec.key_id, deadline=deadline)):
            views[leaf][lo:lo + size] = np.frombuffer(value, np.uint8)
    leaves = [stored_leaf(*s, b) for s, b in zip(specs, buffers)]
    mx.eval(leaves)
    return tree, leaves, label, rec


def _plan(body: bytes, key_digest: str, revision: int, chunk_bytes: int):
    """(tree, leaf specs, [(leaf, offset, name, size)], label) from a verified manifest, or None."""
    try:
        doc = json.loads(body)
        if not (type(doc) is dict and doc.get("object") == revision and doc.get("key") == key_digest
                and type(doc.get("label")) is str and type(doc.get("chunks")) is list):
            return None
        tree = doc["tree"]
        specs = leaf_specs(tree)
        sizes = [leaf_nbytes(*s) for s in specs]
        got, chunks = [0] * len(sizes), []
        for name, digest, size in doc["chunks"]:
            leaf = int(name.split(".")[1])
            if not (type(size) is int and 0 < size <= MAX_VALUE_BYTES and 0 <= leaf < len(sizes)
                    and got[leaf] + size <= sizes[leaf]):
                return None
            chunks.append((leaf, got[leaf], digest, size))
            got[leaf] += size
        if got != sizes or sum(sizes) != chunk_bytes:
            return None
        return tree, specs, chunks, doc["label"]
    except Exception:  # noqa: BLE001 - a verified manifest from another build is still only a miss
        return None
