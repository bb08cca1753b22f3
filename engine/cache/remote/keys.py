"""Remote key names: chained prefix keys per full block, and block keys by content.

A prefix key names "this exact token prefix, in this namespace, for this
team": key_0 = BLAKE3(root || tokens of block 0), key_i = BLAKE3(key_{i-1} ||
tokens of block i), token ids as little-endian int32. The chain makes a key
stand for its whole prefix while each step hashes one block only, and lets a
lookup compute every key of a prompt in one pass. The root binds the
namespace (the engine's: model identity, KV scheme, block format), the
format of these keys and records, and a team salt, so teams sharing a
server never collide. Cryptographic throughout: never Python's `hash()`,
which is salted per process and 64 bits wide.

Blocks are stored under their content name (BLAKE3 of the value), shared by
every prefix and team that produced the same bytes. No hash tags: blocks and
records spread over a cluster's slots by their own hash (a tag on all keys
would put every block on one node).
"""

from __future__ import annotations

import re
import struct
from typing import Sequence

import blake3
import numpy as np

REMOTE_FORMAT = 1  # of the key derivation and the prefix records; a change is a new key space
_NAME_RE = re.compile(r"[0-9a-f]{64}")
_INT32_MAX = 2**31 - 1


def _field(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b  # length-prefixed: ("ab", "c") and ("a", "bc") differ


def namespace_root(namespace: str, salt: str = "") -> bytes:
    if not isinstance(namespace, str) or not namespace or len(namespace) > 1024:
        raise ValueError(f"namespace must be a non-empty string of at most 1024 characters, got {namespace!r:.80}")
    if not isinstance(salt, str):
        raise TypeError(f"salt must be a string, got {type(salt).__name__}")
    data = b"mlxcache-kernel remote prefix root" + _field(namespace.encode()) + _field(
        str(REMOTE_FORMAT).encode()) + _field(salt.encode())
    return blake3.blake3(data).digest()


def token_blocks(tokens: Sequence[int], block_size: int) -> np.ndarray:
    """The full blocks of `tokens` as a (n_blocks, block_size) little-endian int32 array."""
    if not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError("tokens must be a flat sequence of integer token ids")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX):
        raise ValueError("token ids must lie in [0, 2**31): they are hashed as int32")
    n = arr.size // block_size
    return arr[: n * block_size].astype("<i4").reshape(n, block_size)


def prefix_keys(namespace_root: bytes, tokens: Sequence[int], block_size: int) -> list[bytes]:
    """One 32-byte key per full block of `tokens`, each naming the prefix that ends there."""
    if not isinstance(namespace_root, bytes) or len(namespace_root) != 32:
        raise ValueError("namespace_root must be the 32 bytes of namespace_root()")
    keys, parent = [], namespace_root
    for block in token_blocks(tokens, block_size):
        parent = blake3.blake3(parent + block.tobytes()).digest()
        keys.append(parent)
    return keys


def is_block_name(name) -> bool:
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None


def block_name(value: bytes) -> str:
    """A block's name: BLAKE3 of its whole value (bytes or memoryview), hex."""
    return blake3.blake3(value, max_threads=blake3.blake3.AUTO if len(value) >= 1 << 22 else 1).hexdigest()


class KeySpace:
    """Redis key strings under one prefix (so several deployments can share a server)."""

    def __init__(self, prefix: str = "mlxcache"):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", prefix):
            raise ValueError(f"key prefix must match [A-Za-z0-9_.-]{{1,64}}, got {prefix!r}")
        self.prefix = prefix

    def block(self, name: str) -> str:
        return f"{self.prefix}:blk:{name}"

    def record(self, key: bytes) -> str:
        return f"{self.prefix}:rec{REMOTE_FORMAT}:{key.hex()}"
