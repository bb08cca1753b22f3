"""The remote tier: KV blocks and prefix records shared across machines in Redis / Valkey.

Below RAM and SSD. Blocks are the SSD tier's immutable block values, stored
encrypted; prefix records (one per full block, at a chained key of the token
prefix) say which block holds each span, authenticated by their AEAD tag. Keys and
the encryption key derive from the team secret: without it nobody can find, test or
forge what a team stored, and teams sharing a server never collide. A
shared tier without a secret is refused unless chosen by name (insecure).
Nothing here knows MLX or the SSD format: the engine hands in bytes and gets
bytes back, and every remote problem is a miss.

Records and block values are encrypted (AES-256-GCM under a key derived
from the secret, keys.TeamKeys.encrypt): a server reader sees key names,
sizes and access times, not KV, tokens or block names. The secret stops
forgery, probing and reading by outsiders; per-writer signatures and the team's allow-list (writers.py)
say which member wrote a record, and revoking one drops its records and
the local copies taken from them (origins.py).

    config.py      URLs, redaction              credentials.py  secrets, passwords, files, opt-out
    keys.py        keyed prefix keys, key ids   records.py      sealed records, the one parser
    breaker.py     circuit breaker              meter.py        bandwidth, fetch vs recompute
    client.py      redis-py, deadlines          publish_queue.py the background thread
    writers.py     Ed25519 keys, allow-list     origins.py      which local entries came from whom
    publish.py     uploads, best-effort writes  tier.py         RemoteTier: bounded reads
    reads.py       block values, one check each, read ahead
"""

from .config import RemoteConfig, RemoteConfigError, parse_remote_url, redact
from .credentials import RemoteSettings, resolve
from .keys import REMOTE_FORMAT, TeamKeys, block_name
from .publish import Value
from .records import ExactRecord, RemoteRecord
from .tier import RemoteError, RemoteMiss, RemoteTier

__all__ = ["REMOTE_FORMAT", "ExactRecord", "RemoteConfig", "RemoteConfigError", "RemoteError", "RemoteMiss",
           "RemoteRecord", "RemoteSettings", "RemoteTier", "TeamKeys", "Value", "block_name", "parse_remote_url",
           "redact", "resolve"]
