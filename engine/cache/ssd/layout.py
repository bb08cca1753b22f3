"""Where the SSD tier keeps what, under its root directory (shared by every process)::

    root/catalog.db                                  the catalogue (../catalog/)
    root/.heartbeats/<owner>                         each open catalogue's heartbeat (../catalog/liveness.py)
    root/<namespace>/<key>.<tag>.ckpt                committed checkpoints (manifests): each write a new tag
    root/<namespace>/.<name>.<process tag>.<n>.tmp   writes in progress (ignored)
    root/blocks/<BLAKE3>.blk                         KV token spans, shared (blocks.py)
    root/quarantine/                                 files found bad, kept as evidence
"""

from __future__ import annotations

import re

NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
MANIFEST_NAME_RE = re.compile(r"([0-9a-f]{64})(?:\.[0-9a-f]{8})?\.ckpt")  # <key>[.<tag>].ckpt
SUFFIX = ".ckpt"
QUARANTINE = "quarantine"
BLOCKS = "blocks"
HEARTBEATS = ".heartbeats"
