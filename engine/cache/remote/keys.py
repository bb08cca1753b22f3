"""Remote key names, derived from the team secret: prefix keys, block keys, the encryption key.

A prefix key names "this exact token prefix, in this namespace, for this
team": key_0 = H(root || tokens of block 0), key_i = H(key_{i-1} || tokens
of block i), token ids as little-endian int32, H the BLAKE3 keyed with a key
derived from the team secret. The chain makes a key stand for its whole
prefix while each step hashes one block only. Keyed at every step, so
someone without the secret can neither compute the key of a guessed prompt
nor extend a key they see on the server by a guessed block: they cannot
test whether a prompt was run. The root binds the namespace (model
identity, KV scheme, backend, block format) and the format of these keys.

Blocks are stored under a keyed hash of their content name, so they too
cannot be probed for by someone who computed the same KV, and encrypted
(AES-256-GCM, `encrypt`, the key name as associated data), as records are:
the server holds no plain KV, token ids or block names to compare a guessed
prompt's against. A block is still verified by the BLAKE3 of its plaintext,
which the record (signed by its writer) names: the AEAD only says that a
holder of the secret sealed it.

Every Redis key carries the secret's key id (`<prefix>:<key id>:...`): two
teams never share a key, and after a rotation an operator can find (SCAN)
and drop the old secret's keys. Without a secret (`insecure`, opted into by
name) the same scheme runs unkeyed under the key id "open": anyone who can
reach the server can then compute keys and forge records.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import re
import time
from typing import Sequence

import blake3
import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ...config import reveal

REMOTE_FORMAT = 4  # of the key derivation and the records; a change is a new key space (4: layouts stored apart)
OPEN = "open"  # the key id of the unauthenticated key space
MIN_SECRET_BYTES = 16
_NAME_RE = re.compile(r"[0-9a-f]{64}")
_INT32_MAX = 2**31 - 1


def _context(what: str) -> str:
    return f"mlxcache-kernel 2026-12 remote tier v{REMOTE_FORMAT} {what}"


NONCE_BYTES = 12
AEAD_OVERHEAD = NONCE_BYTES + 16  # a random nonce before the ciphertext, the GCM tag after it
MIN_DISTINCT_BYTES = 8
SCRYPT = dict(n=2**14, r=8, p=1)  # ~70 ms once per secret and process: each offline guess costs as much
_stretched: dict = {}  # BLAKE3 of a secret -> its stretched form (a process derives each once)


def check_secret(secret) -> bytes:
    """A secret's bytes; ValueError for one too short or too repetitive to be guessed slowly.
    Make one with `openssl rand -base64 32`."""
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a remote secret must be at least {MIN_SECRET_BYTES} bytes (make one with "
                         "`openssl rand -base64 32`)")
    if len(set(secret)) < MIN_DISTINCT_BYTES:
        raise ValueError(f"a remote secret needs at least {MIN_DISTINCT_BYTES} distinct characters; this one is "
                         "too weak (make one with `openssl rand -base64 32`)")
    return bytes(secret)


def stretch(secret: bytes) -> bytes:
    """The secret through scrypt, once per process: every key below derives from this, so the key id
    in every key name is no fast oracle for guessing a team phrase offline (~70 ms a guess)."""
    tag = blake3.blake3(secret).digest()
    out = _stretched.get(tag)
    if out is None:
        out = hashlib.scrypt(secret, salt=_context("secret stretch").encode(), dklen=32, maxmem=64 << 20, **SCRYPT)
        _stretched[tag] = out
    return out


class TeamKeys:
    """Everything one team secret derives (or, with None, the open key space)."""

    def __init__(self, secret: bytes | None, not_after: float | None = None):
        self.not_after = not_after  # epoch seconds after which this secret is not read (None: no end)
        if secret is None:  # the open space's "encryption" key is public: integrity against corruption only
            self._chain = None
            self.key_id = OPEN
            self._key = blake3.blake3(_context("open space").encode()).digest()
        else:
            secret = stretch(check_secret(secret))
            self._chain = blake3.blake3(secret, derive_key_context=_context("prefix keys")).digest()
            self.key_id = blake3.blake3(secret, derive_key_context=_context("key id")).hexdigest()[:12]
            self._key = blake3.blake3(secret, derive_key_context=_context("encryption")).digest()
        self._aead = AESGCM(self._key)

    def encrypt(self, ad: bytes, data: bytes) -> bytes:
        """AES-256-GCM under this secret, a fresh random nonce, `ad` (what names the value) bound in:
        a value copied to another key does not open. len(data) + AEAD_OVERHEAD bytes."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data, ad)

    def decrypt(self, ad: bytes, value) -> bytes | None:
        """The plaintext of an encrypt(ad, ...) value, or None (another key, another name, altered)."""
        if len(value) < AEAD_OVERHEAD:
            return None
        view = memoryview(value)
        try:
            return self._aead.decrypt(view[:NONCE_BYTES], view[NONCE_BYTES:], ad)
        except InvalidTag:
            return None

    def decryptor(self, ad: bytes, nonce: bytes):
        """A streaming AES-256-GCM decryptor of an encrypt(ad, ...) value whose first NONCE_BYTES are
        `nonce` (reads.py opens a large value piece by piece as it arrives): what its update_into()
        writes is unauthenticated until finalize_with_tag(the value's last 16 bytes) returns."""
        d = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).decryptor()
        d.authenticate_additional_data(ad)
        return d

    @property
    def key_id_bytes(self) -> bytes:
        """The key id as the 6 bytes a packed record carries."""
        return b"open\0\0" if self._chain is None else bytes.fromhex(self.key_id)

    @property
    def authenticated(self) -> bool:
        return self._chain is not None

    def _hash(self, data: bytes) -> bytes:
        return (blake3.blake3(data, key=self._chain) if self._chain else blake3.blake3(data)).digest()

    def root(self, namespace: str) -> bytes:
        if not isinstance(namespace, str) or not namespace or len(namespace) > 1024:
            raise ValueError(f"namespace must be a non-empty string of at most 1024 characters, got {namespace!r:.80}")
        return self._hash(b"mlxcache-kernel remote prefix root" + _field(namespace.encode())
                          + _field(str(REMOTE_FORMAT).encode()))

    def prefix_keys(self, namespace: str, tokens: Sequence[int], block_size: int) -> list[bytes]:
        """One 32-byte key per full block of `tokens`, each naming the prefix that ends there."""
        keys, parent = [], self.root(namespace)
        for block in token_blocks(tokens, block_size):
            parent = self._hash(parent + block.tobytes())
            keys.append(parent)
        return keys

    def block_id(self, name: str) -> str:
        """The Redis-key part for block `name` (a 64-hex BLAKE3 name)."""
        return self._hash(b"block " + name.encode()).hex() if self._chain else name

    def layout_id(self, layout: bytes) -> bytes:
        """The 32-byte name of a layout (a publication's layout JSON), keyed: a chain record carries it,
        the layout value is stored once under it, and no one without the secret can compute it."""
        return self._hash(b"layout " + layout)


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(4, "little") + b  # length-prefixed: ("ab", "c") and ("a", "bc") differ


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


def is_block_name(name) -> bool:
    return isinstance(name, str) and _NAME_RE.fullmatch(name) is not None


def block_name(value: bytes) -> str:
    """A block's name: BLAKE3 of its whole value (bytes or memoryview), hex."""
    return blake3.blake3(value, max_threads=blake3.blake3.AUTO if len(value) >= 1 << 22 else 1).hexdigest()


class KeySpace:
    """Redis key strings under one prefix and one key id (several deployments and teams share a server)."""

    def __init__(self, keys: TeamKeys, prefix: str = "mlxcache"):
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", prefix):
            raise ValueError(f"key prefix must match [A-Za-z0-9_.-]{{1,64}}, got {prefix!r}")
        self.keys, self.base = keys, f"{prefix}:{keys.key_id}"

    def block(self, name: str) -> str:
        return f"{self.base}:blk:{self.keys.block_id(name)}"

    def record(self, key: bytes) -> str:
        return f"{self.base}:rec:{key.hex()}"

    def converted(self, key: bytes) -> str:
        """A chain record of a checkpoint that serves only from its minimum reusable offset (records.CONVERTED)."""
        return f"{self.base}:crec:{key.hex()}"

    def exact(self, key: bytes) -> str:
        return f"{self.base}:ext:{key.hex()}"

    def object(self, root: bytes) -> str:
        return f"{self.base}:obj:{root.hex()}"

    def tomb(self, key: bytes) -> str:
        return f"{self.base}:tomb:{key.hex()}"

    def layout(self, layout_id: bytes) -> str:
        """A publication's layout, stored once for all its chain records (records.seal_layout)."""
        return f"{self.base}:lay:{layout_id.hex()}"


def secrets_of(secret) -> list[tuple[bytes, float | None]]:
    """[(current, not after), (previous, not after)...] from bytes, a str (one secret per line) or a
    sequence of them. A line `not-after=YYYY-MM-DD <secret>` ends that secret with that day (UTC)."""
    secret = reveal(secret)
    if secret is None:
        return []
    if isinstance(secret, str):
        secret = [s for s in secret.splitlines() if s.strip()]
    items = [secret] if isinstance(secret, (bytes, bytearray)) else list(secret)
    out = []
    for s in items:
        s = s.encode() if isinstance(s, str) else bytes(s)
        m = _NOT_AFTER.match(s)
        end = None
        if m:
            try:
                day = datetime.date.fromisoformat(m.group(1).decode())
            except ValueError:
                raise ValueError("a remote secret's not-after date must be YYYY-MM-DD") from None
            end = datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.timezone.utc).timestamp() + 86400
            s = s[m.end():]
        out.append((check_secret(s), end))
    return out


_NOT_AFTER = re.compile(rb"not-after=([0-9]{4}-[0-9]{2}-[0-9]{2}) +")


def team_keys(secret) -> list[TeamKeys]:
    """TeamKeys of each secret still valid ([open] for none); a bad one's ValueError raised outside the
    frames that hold it (a traceback shows their variables)."""
    try:
        given = secrets_of(secret)
        keys = [TeamKeys(s, end) for s, end in given if end is None or end > time.time()]
        if given and not keys:
            raise ValueError("every remote secret is past its not-after date: add the team's new secret")
        return keys or [TeamKeys(None)]
    except ValueError as e:
        error = str(e)
    raise ValueError(error) from None
