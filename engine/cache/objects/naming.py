"""Which catalogue namespaces hold objects: one per object key, "obj-" and its digest.

Apart from cache.py so that readers of a directory (the panel's overview) tell objects
from prompt prefixes without loading MLX.
"""

from __future__ import annotations

NAMESPACE_PREFIX = "obj-"


def namespace_of(key_digest: str) -> str:
    return NAMESPACE_PREFIX + key_digest[:60]


def is_object_namespace(ns: str) -> bool:
    return ns.startswith(NAMESPACE_PREFIX)
