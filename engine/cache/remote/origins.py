"""Where local state came from: the remote writer (and secret) behind each entry taken from the remote.

A remote hit is written through to the local SSD tier, and what a cell
then computes on top of it (its answer, the next turn) is derived from it.
Both must follow their writer: when the team revokes the writer (drops its
key from the allow-list) or the secret (drops the key id), they must stop
serving here too, and a member must never publish them as its own (that
would launder another writer's records under its signature, or carry them
across a rotation into the new key space).

So every checkpoint adopted from the remote, and every one whose tokens
extend such a checkpoint, has an origin: (namespace, tokens, writer id,
key id), kept in memory and, with an SSD tier, as a small JSON file per
entry in a private directory beside the catalogue. `sweep()` (at attach,
i.e. at every start with a remote configured) drops the SSD entries of
origins no longer trusted; `of()` says whether a checkpoint is remote-made
(then link.py does not publish it). With no remote configured nothing is
swept: a machine that left the team keeps what it took (say so in the
runbook: clear the cache directory).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import blake3

from ...host import safe_dirs
from ...kv.tokens import token_key

MAX_ORIGIN_FILE_BYTES = 8 << 20


@dataclass(frozen=True)
class Origin:
    namespace: str
    tokens: tuple
    writer: str  # hex writer id; "" for an unsigned record (a team without an allow-list)
    key_id: str


class Origins:
    def __init__(self, root: Path | None):
        self.root = None
        self._lock = threading.Lock()
        self._by_ns: dict[str, list[Origin]] = {}
        if root is None:
            return
        try:  # from the SSD tier's root, never through a link (one is reported: origins kept in RAM)
            self.root = safe_dirs.make_private_dir(root, Path(root).parent)
            names = sorted(n for n in safe_dirs.listdir(self.root, self.root.parent) if n.endswith(".json")
                           and not n.startswith("."))
        except OSError:
            self.root = None
            return
        for name in names:
            o = _load(self.root / name)
            if o is None:
                self._remove([self.root / name])  # unreadable: its entry may stay, but nothing is lost that mattered
            else:
                self._by_ns.setdefault(o.namespace, []).append(o)

    def _remove(self, paths: list) -> None:
        if self.root is not None:
            safe_dirs.unlink_all(paths, self.root.parent)

    def add(self, namespace: str, tokens: Sequence[int], writer: str, key_id: str) -> Origin:
        o = Origin(namespace, tuple(int(t) for t in tokens), writer, key_id)
        with self._lock:
            if o in self._by_ns.get(namespace, ()):
                return o
            self._by_ns.setdefault(namespace, []).append(o)
        if self.root is not None:
            safe_dirs.write_json_atomic(self.root / f"{_name(namespace, o.tokens)}.json",
                              {"ns": namespace, "tokens": list(o.tokens), "writer": writer, "kid": key_id},
                              root=self.root.parent)
        return o

    def discard(self, namespace: str, tokens: Sequence[int]) -> None:
        """Forget the origin of exactly (namespace, tokens): the entry there is this member's own now."""
        tokens = tuple(int(t) for t in tokens)
        with self._lock:
            kept = [o for o in self._by_ns.get(namespace, ()) if o.tokens != tokens]
            if len(kept) == len(self._by_ns.get(namespace, ())):
                return
            self._by_ns[namespace] = kept
        if self.root is not None:
            self._remove([self.root / f"{_name(namespace, tokens)}.json"])

    def of(self, namespace: str, tokens: Sequence[int]) -> Origin | None:
        """The origin of a checkpoint of `tokens`: its own, or that of a remote entry it extends."""
        tokens = tuple(tokens)
        with self._lock:
            candidates = list(self._by_ns.get(namespace, ()))
        return next((o for o in candidates if len(o.tokens) <= len(tokens) and tokens[:len(o.tokens)] == o.tokens),
                    None)

    def derived(self, namespace: str, tokens: Sequence[int]) -> Origin | None:
        """Like of(), and a checkpoint that extends a remote entry gets its own origin (the same writer)."""
        o = self.of(namespace, tokens)
        if o is not None and len(o.tokens) != len(tokens):
            self.add(namespace, tokens, o.writer, o.key_id)
        return o

    def sweep(self, trusted: Callable[[Origin], bool], remove: Callable[[list], int] | None) -> int:
        """Drop every origin `trusted` refuses, and (through `remove`, given [(ns, key)]) its SSD entry."""
        with self._lock:
            gone = [o for os_ in self._by_ns.values() for o in os_ if not trusted(o)]
            for o in gone:
                self._by_ns[o.namespace].remove(o)
        if gone and remove is not None:
            remove([(o.namespace, token_key(o.tokens)) for o in gone])
        if self.root is not None:
            self._remove([self.root / f"{_name(o.namespace, o.tokens)}.json" for o in gone])
        return len(gone)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_ns.values())


def _name(namespace: str, tokens: tuple) -> str:
    return blake3.blake3(namespace.encode() + b"\0" + token_key(tokens).encode()).hexdigest()[:40]


def _load(path: Path) -> Origin | None:
    try:
        if path.stat().st_size > MAX_ORIGIN_FILE_BYTES:
            return None
        d = json.loads(path.read_text())
        tokens = d["tokens"]
        if not (isinstance(d["ns"], str) and isinstance(d["writer"], str) and isinstance(d["kid"], str)
                and isinstance(tokens, list) and all(type(t) is int for t in tokens)):
            return None
        return Origin(d["ns"], tuple(tokens), d["writer"], d["kid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
