"""Who wrote a record: per-writer Ed25519 signing keys and the team's allow-list of public keys.

The team secret (keys.py) says "a member of this team"; it cannot say which
member, and every holder of it can seal anything. So each writer also holds
its own Ed25519 signing key and signs what it publishes; a team lists the
public keys it accepts (`Writers`). A reader with an allow-list takes only
records signed by a listed writer; dropping a key from the list makes that
writer's records misses everywhere, and the SSD copies a member took from
the remote (origins.py remembers their writer) are dropped at the next
start. A read-only member needs no signing key; a member without one
publishes nothing to a tier that has an allow-list (its records would be
refused anyway).

Keys as text: a private key is its 32-byte seed in base64 or hex (or a PEM
"PRIVATE KEY"); a public key the same 32 bytes raw, base64 or hex, with an
optional `name=` before it. `python -m mlxcache_kernel.engine.cache.remote.writers`
prints a new pair. A writer's id on the wire is the first 8 bytes of the
BLAKE3 of its public key; only ids on the reader's own list are looked up.

Library: `cryptography` (pyca), the maintained binding of OpenSSL that
pip, TLS stacks and most of PyPI already depend on; Ed25519 verification
costs ~50 us, and a lookup verifies one signature (records.py).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ...config import RemoteConfigError, reveal

SIG_BYTES = 64
WRITER_ID_BYTES = 8
NO_WRITER = bytes(WRITER_ID_BYTES)  # an unsigned record (a writer without a key, no allow-list)
NO_SIGNATURE = bytes(SIG_BYTES)
_NAME_RE = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def _raw32(text: str, what: str) -> bytes:
    text = text.strip()
    for decode in (bytes.fromhex, lambda t: base64.b64decode(t, validate=True),
                   lambda t: base64.urlsafe_b64decode(t + "=" * (-len(t) % 4))):
        try:
            raw = decode(text)
        except (ValueError, binascii.Error):
            continue
        if len(raw) == 32:
            return raw
    raise RemoteConfigError(f"{what}: not a 32-byte Ed25519 key in base64 or hex")


def writer_id(public: bytes) -> bytes:
    return blake3.blake3(b"mlxcache-kernel writer id " + public).digest()[:WRITER_ID_BYTES]


class SigningKey:
    """One writer's Ed25519 private key; its repr and str never show it."""

    __slots__ = ("_key", "public", "id")

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        self.public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.id = writer_id(self.public)

    @classmethod
    def load(cls, value) -> "SigningKey":
        value = reveal(value)
        if isinstance(value, SigningKey):
            return value
        if isinstance(value, Ed25519PrivateKey):
            return cls(value)
        if isinstance(value, (bytes, bytearray)) and len(value) == 32:
            return cls(Ed25519PrivateKey.from_private_bytes(bytes(value)))
        text = value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else value
        if not isinstance(text, str):
            raise RemoteConfigError("remote signing key: expected base64, hex or PEM text")
        if "PRIVATE KEY" in text:
            try:
                key = serialization.load_pem_private_key(text.encode(), password=None)
            except (ValueError, TypeError):
                raise RemoteConfigError("remote signing key: a PEM that is not an unencrypted private key") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise RemoteConfigError("remote signing key: the PEM holds a key that is not Ed25519")
            return cls(key)
        return cls(Ed25519PrivateKey.from_private_bytes(_raw32(text, "remote signing key")))

    @classmethod
    def generate(cls) -> "SigningKey":
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def seed_text(self) -> str:
        """The private key as base64 (for writing a new key to a file: `main`)."""
        raw = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                      serialization.NoEncryption())
        return base64.b64encode(raw).decode()

    def public_text(self) -> str:
        return base64.b64encode(self.public).decode()

    def __repr__(self) -> str:
        return f"SigningKey(public {self.public_text()}, private key hidden)"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a signing key is not pickled")


@dataclass(frozen=True)
class Writers:
    """The team's allow-list: writer id -> (name, public key). Empty: any member of the team (MAC only)."""

    keys: dict = field(default_factory=dict)  # id bytes -> (name, Ed25519PublicKey)

    @classmethod
    def parse(cls, value) -> "Writers":
        """From text (entries split by commas, whitespace or lines; `name=key` or `key`) or a sequence."""
        if value is None or isinstance(value, Writers):
            return value or cls()
        items = re.split(r"[\s,]+", value.strip()) if isinstance(value, str) else list(value)
        out = {}
        for n, item in enumerate(i for i in items if i):
            if isinstance(item, (bytes, bytearray)) and len(item) == 32:
                name, raw = f"writer{n}", bytes(item)
            else:
                item = str(item)
                name, eq, text = item.partition("=") if "=" in item.rstrip("=") else ("", "", item)
                if eq and not _NAME_RE.fullmatch(name):
                    raise RemoteConfigError(f"remote writers: a name must match {_NAME_RE.pattern}")
                raw = _raw32(text, f"remote writers entry {n + 1}")
                name = name or f"writer{n}"
            out[writer_id(raw)] = (name, Ed25519PublicKey.from_public_bytes(raw))
        return cls(out)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def verify(self, wid: bytes, signature: bytes, data: bytes) -> str | None:
        """None if `signature` by allow-listed writer `wid` is good for `data`; else "unknown_writer" / "signature"."""
        entry = self.keys.get(wid)
        if entry is None:
            return "unknown_writer"
        try:
            entry[1].verify(signature, data)
        except InvalidSignature:
            return "signature"
        return None

    def allows(self, wid_hex: str) -> bool:
        """Is the writer with this id (hex) on the list? Any writer is, with no list."""
        return not self.keys or bytes.fromhex(wid_hex) in self.keys

    def name(self, wid: bytes) -> str:
        return self.keys[wid][0] if wid in self.keys else wid.hex()

    def __repr__(self) -> str:
        return f"Writers({', '.join(n for n, _ in self.keys.values()) or 'any member'})"


def main() -> None:  # python -m mlxcache_kernel.engine.cache.remote.writers
    key = SigningKey.generate()
    print("private (keep it: MLXCACHE_REMOTE_SIGNING_KEY_FILE):", key.seed_text())
    print("public (the team adds it to MLXCACHE_REMOTE_WRITERS):  ", key.public_text())


if __name__ == "__main__":
    main()
