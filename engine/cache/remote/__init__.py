"""The remote tier: KV blocks and prefix records shared across machines in Redis / Valkey.

Below RAM and SSD. Blocks are the SSD tier's immutable block values, stored
verbatim under their BLAKE3 name; prefix records (one per full block, at a
chained key of the token prefix) say which block holds each span and carry
a keyed MAC. Nothing here knows MLX or the SSD format: the engine hands in
bytes and gets bytes back, and every remote problem is a miss.

Everyone with access to the server can read what is stored there, prompts
included (token ids in blocks, spans in records): share a remote only with
people who may see each other's prompts. The MAC stops forged records from
people without the team secret, not readers.

    config.py     URLs, redaction             keys.py      prefix keys, block names
    records.py    sealed prefix records       breaker.py   circuit breaker
    meter.py      bandwidth, fetch vs recompute
    client.py     redis-py client, safe error text
    publisher.py  background publication     tier.py      RemoteTier
"""

from .config import RemoteConfig, RemoteConfigError, parse_remote_url, redact
from .keys import REMOTE_FORMAT, block_name, namespace_root, prefix_keys
from .records import RemoteRecord
from .tier import RemoteError, RemoteMiss, RemoteTier

__all__ = ["REMOTE_FORMAT", "RemoteConfig", "RemoteConfigError", "RemoteError", "RemoteMiss", "RemoteRecord",
           "RemoteTier", "block_name", "namespace_root", "parse_remote_url", "prefix_keys", "redact"]
