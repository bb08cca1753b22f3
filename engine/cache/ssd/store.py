"""The SSD tier: checkpoint files under one root, indexed from their headers.

    root/<namespace>/<sha256 of token ids>.ckpt    committed checkpoints
    root/<namespace>/.<name>.<pid>.<n>.tmp          writes in progress (ignored)
    root/quarantine/                                 files found bad

The index is built at start from headers only and kept current by our own
commits; a miss rescans one namespace directory (throttled) so files that
another process sharing the root committed become visible. Only renamed,
complete files are ever indexed.

Identity: the caller registers the expected identity of each namespace.
Files of unregistered namespaces are indexed (they count against capacity)
but never served; registering checks them and quarantines mismatches. A
commit through `publish` registers its namespace if nobody did.

Thread safety: all index state is under one lock; any thread may call in.
No MLX here: `read` verifies into buffers the caller allocates (restore.py).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ...kv.tokens import common_prefix_len, token_key
from ...system import make_private_dir
from . import format as fmt
from .format import CorruptCheckpoint, FileInfo, Header

NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
QUARANTINE = "quarantine"
SUFFIX = ".ckpt"
STALE_TEMP_S = 3600.0
REFRESH_INTERVAL_S = 0.5


class CheckpointUnavailable(Exception):
    """A checkpoint could not be restored; treat it as a cache miss."""


def validate_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace) or namespace == QUARANTINE:
        raise ValueError(f"invalid namespace {namespace!r}: use [A-Za-z0-9_-]{{1,64}}")
    return namespace


@dataclass(eq=False)
class IndexEntry:
    namespace: str
    key: str
    path: Path
    tokens: tuple
    trimmable: bool
    min_reusable_offset: int
    file_bytes: int
    raw_bytes: int
    identity: dict
    last_use: float
    match_len: int | None = None  # set on copies returned by find()
    _arr: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def can_serve(self, n: int) -> bool:
        if n < 1 or n > len(self.tokens) or n < self.min_reusable_offset:
            return False
        return n == len(self.tokens) or self.trimmable



class CheckpointStore:
    def __init__(self, root, *, ssd_budget_bytes: int | None = None, on_event: Callable[[dict], None] | None = None):
        self.root = Path(root)
        self.ssd_budget_bytes = ssd_budget_bytes
        self.on_event = on_event
        self._lock = threading.RLock()
        self._entries: dict[tuple, IndexEntry] = {}  # (namespace, key) -> entry
        self._identities: dict[str, dict] = {}
        self._last_refresh: dict[str, float] = {}
        self._reported: set = set()
        self._protected: set = set()  # (namespace, key) of named checkpoints: never superseded or capped
        self._clock = 0.0
        self._stats = {"quarantined": 0, "restores": 0, "restore_bytes": 0, "restore_seconds": 0.0, "evicted": 0}
        make_private_dir(self.root)
        make_private_dir(self.root / QUARANTINE)
        for d in sorted(self.root.iterdir()):
            if d.is_dir() and d.name != QUARANTINE and NAMESPACE_RE.fullmatch(d.name):
                self._clean_stale_temps(d)
                self._scan(d.name)

    # --- index maintenance ---

    def _tick(self) -> float:
        # wall-clock LRU stamps (files found at start use their creation
        # time), nudged so two uses never tie
        self._clock = max(self._clock + 1e-6, time.time())
        return self._clock

    def _clean_stale_temps(self, d: Path) -> int:
        removed, now = 0, time.time()
        for name in os.listdir(d):
            if name.startswith(".") and name.endswith(".tmp"):
                try:
                    if now - os.stat(d / name).st_mtime > STALE_TEMP_S:
                        os.unlink(d / name)
                        removed += 1
                except OSError:
                    pass
        return removed

    def _entry_from_header(self, path: Path, h: Header) -> IndexEntry:
        key = path.name[: -len(SUFFIX)]
        if h.namespace != path.parent.name:
            raise CorruptCheckpoint("header namespace does not match its directory")
        if token_key(h.tokens) != key:
            raise CorruptCheckpoint("file name does not match its tokens")
        return IndexEntry(
            h.namespace, key, path, h.tokens, h.trimmable, h.min_reusable_offset,
            h.file_size, h.raw_bytes, h.identity, h.created,
        )

    def _scan(self, namespace: str) -> None:
        """Index files of one namespace not yet indexed; forget vanished ones."""
        d = self.root / namespace
        try:
            names = {n for n in os.listdir(d) if n.endswith(SUFFIX) and not n.startswith(".")}
        except FileNotFoundError:
            names = set()
        with self._lock:
            self._last_refresh[namespace] = time.monotonic()
            known = {e.key + SUFFIX: k for k, e in self._entries.items() if k[0] == namespace}
            for name in set(known) - names:
                del self._entries[known[name]]
            for name in sorted(names - set(known)):
                path = d / name
                try:
                    e = self._entry_from_header(path, fmt.read_header(path))
                except FileNotFoundError:
                    continue
                except (CorruptCheckpoint, OSError) as exc:
                    self._quarantine(path, getattr(exc, "reason", None) or repr(exc))
                    continue
                if self._identity_ok(e):
                    self._entries[(namespace, e.key)] = e

    def _identity_ok(self, e: IndexEntry) -> bool:
        want = self._identities.get(e.namespace)
        if want is not None and e.identity != want:
            self._quarantine(e.path, "identity mismatch")
            return False
        return True

    def register_namespace(self, namespace: str, identity: dict) -> None:
        """Declare the identity files of `namespace` must carry; check them."""
        validate_namespace(namespace)
        with self._lock:
            self._identities[namespace] = dict(identity)
            for k, e in list(self._entries.items()):
                if k[0] == namespace and not self._identity_ok(e):
                    self._entries.pop(k, None)
            self._scan(namespace)

    def _quarantine(self, path: Path, reason: str) -> None:
        with self._lock:
            for k, e in list(self._entries.items()):
                if e.path == path:
                    del self._entries[k]
            dest = self.root / QUARANTINE / f"{path.parent.name}.{path.name}.{time.time_ns()}"
            try:
                os.replace(path, dest)
            except FileNotFoundError:
                return  # another process moved or removed it first
            except OSError:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            self._stats["quarantined"] += 1
            if str(path) not in self._reported:
                self._reported.add(str(path))
                self._emit({"type": "quarantine", "path": str(path), "reason": reason})

    def _emit(self, event: dict) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                pass  # an observer must not break the store

    def protect(self, namespace: str, tokens: Sequence[int], on: bool = True) -> None:
        """Exempt the file of exactly `tokens` from supersession, the capacity cap and clear()."""
        key = (validate_namespace(namespace), token_key(tokens))
        with self._lock:
            (self._protected.add if on else self._protected.discard)(key)

    def contains(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether a committed file holds exactly `tokens`."""
        with self._lock:
            return (namespace, token_key(tokens)) in self._entries

    # --- lookup ---

    def find(self, prompt_tokens: Sequence[int], namespace: str, *, max_len: int | None = None) -> IndexEntry | None:
        """Longest usable cached prefix of `prompt_tokens` (at most len-1 tokens).

        Returns a copy of the index entry with `match_len` set, or None. No
        I/O on a hit; a miss rescans the namespace directory (throttled).
        """
        validate_namespace(namespace)
        hit = self._find(prompt_tokens, namespace, max_len)
        if hit is None and time.monotonic() - self._last_refresh.get(namespace, 0.0) >= REFRESH_INTERVAL_S:
            self._scan(namespace)
            hit = self._find(prompt_tokens, namespace, max_len)
        return hit

    def _find(self, prompt_tokens, namespace, max_len) -> IndexEntry | None:
        cap = len(prompt_tokens) - 1
        if max_len is not None:
            cap = min(cap, max_len)
        if cap < 1:
            return None
        prompt = np.asarray(prompt_tokens, dtype=np.int64)
        best, best_rank = None, None
        with self._lock:
            if namespace not in self._identities:
                return None
            for (ns, _), e in self._entries.items():
                if ns != namespace:
                    continue
                if e._arr is None:
                    e._arr = np.asarray(e.tokens, dtype=np.int64)
                n = min(common_prefix_len(e._arr, prompt), cap)
                if not e.can_serve(n):
                    continue
                # longest, then exact files (no trim), then smaller reads, then recent
                rank = (n, n == len(e), -e.file_bytes, e.last_use)
                if best_rank is None or rank > best_rank:
                    best, best_rank = e, rank
            return None if best is None else replace(best, match_len=best_rank[0], _arr=None)

    def has_durable_prefix(self, tokens: Sequence[int], namespace: str) -> bool:
        """Whether a committed file can serve exactly `tokens` (exact, or trimmable and longer)."""
        tokens = tuple(int(t) for t in tokens)
        with self._lock:
            if (namespace, token_key(tokens)) in self._entries:
                return True
            n = len(tokens)
            return any(
                ns == namespace and len(e) > n and e.can_serve(n) and e.tokens[:n] == tokens
                for (ns, _), e in self._entries.items()
            )

    def entries(self) -> list[IndexEntry]:
        with self._lock:
            return [replace(e, _arr=None) for e in self._entries.values()]

    # --- restore ---

    def read(self, entry: IndexEntry, allocate: Callable, build: Callable[[Header], Any]):
        """Read and verify `entry`'s file into buffers from `allocate(name, dtype, shape)`,
        then return `build(header)` (see restore.py).

        Any problem quarantines the file and raises CheckpointUnavailable.
        """
        t0 = time.perf_counter()
        path = entry.path
        try:
            h = fmt.read_header(path)
            if h.tokens != tuple(entry.tokens) or h.namespace != entry.namespace:
                raise CorruptCheckpoint("file no longer holds the indexed checkpoint")
            want = self._identities.get(h.namespace)
            if want is None:  # nothing to check against: a miss, not a bad file
                raise CheckpointUnavailable(f"namespace {h.namespace} is not registered")
            if h.identity != want:
                raise CorruptCheckpoint("identity mismatch")
            fmt.read_tensors(path, h, allocate)
            result = build(h)
        except FileNotFoundError:
            with self._lock:
                self._entries.pop((entry.namespace, entry.key), None)
            raise CheckpointUnavailable(f"{path}: file vanished") from None
        except (CorruptCheckpoint, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
            reason = getattr(exc, "reason", None) or f"{type(exc).__name__}: {exc}"
            self._quarantine(path, reason)
            raise CheckpointUnavailable(f"{path}: {reason}") from None
        with self._lock:
            e = self._entries.get((entry.namespace, entry.key))
            if e is not None:
                e.last_use = self._tick()
            self._stats["restores"] += 1
            self._stats["restore_bytes"] += h.raw_bytes
            self._stats["restore_seconds"] += time.perf_counter() - t0
        return result

    # --- commits ---

    def prepare_path(self, namespace: str, tokens: Sequence[int]) -> Path:
        """Final path for a checkpoint of `tokens`; creates the namespace dir."""
        return make_private_dir(self.root / validate_namespace(namespace)) / (token_key(tokens) + SUFFIX)

    def publish(self, info: FileInfo) -> IndexEntry:
        """Index a file the writer has renamed into place; supersede; cap."""
        h = info.header
        with self._lock:
            if h.namespace not in self._identities:
                self._identities[h.namespace] = dict(h.identity)
            e = self._entry_from_header(Path(info.path), h)
            e.last_use = self._tick()
            if not self._identity_ok(e):
                raise CorruptCheckpoint("identity mismatch")
            self._entries[(e.namespace, e.key)] = e  # replaces an exact duplicate
            if e.trimmable:
                for k, old in list(self._entries.items()):
                    if (
                        k[0] == e.namespace and old is not e and len(old) < len(e) and k not in self._protected
                        and len(old) >= e.min_reusable_offset and e.tokens[: len(old)] == old.tokens
                    ):
                        self._drop(old, "superseded")
            self._enforce_budget(keep=e)
            return replace(e, _arr=None)

    def _drop(self, e: IndexEntry, reason: str) -> None:
        self._entries.pop((e.namespace, e.key), None)
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            pass
        self._stats["evicted"] += 1
        self._emit({"type": "evict", "path": str(e.path), "reason": reason, "nbytes": e.file_bytes})

    def _enforce_budget(self, keep: IndexEntry | None = None) -> None:
        if self.ssd_budget_bytes is None:
            return
        total = sum(e.file_bytes for e in self._entries.values())
        for e in sorted(self._entries.values(), key=lambda e: e.last_use):
            if total <= self.ssd_budget_bytes:
                break
            if e is keep or (e.namespace, e.key) in self._protected:
                continue
            self._drop(e, "capacity")
            total -= e.file_bytes

    def remove(self, entry: IndexEntry) -> None:
        with self._lock:
            self._entries.pop((entry.namespace, entry.key), None)
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass

    def verify_all(self) -> list[tuple]:
        """Re-read and re-hash every indexed file; quarantine the bad ones."""
        bad = []
        for e in self.entries():
            try:
                h = fmt.read_header(e.path)
                if h.identity != self._identities.get(h.namespace, h.identity):
                    raise CorruptCheckpoint("identity mismatch")
                fmt.read_tensors(e.path, h, lambda n, dt, sh: np.empty(sh, fmt.host_dtype(dt)))
            except FileNotFoundError:
                with self._lock:
                    self._entries.pop((e.namespace, e.key), None)
            except (CorruptCheckpoint, OSError) as exc:
                reason = getattr(exc, "reason", None) or repr(exc)
                self._quarantine(e.path, reason)
                bad.append((e.path, reason))
        return bad

    def clear(self) -> None:
        """Delete every committed checkpoint except protected (named) ones, and the quarantine."""
        with self._lock:
            for k, e in list(self._entries.items()):
                if k not in self._protected:
                    self.remove(e)
            keep = {e.path.name for k, e in self._entries.items()}
            for d in self.root.iterdir():
                if d.is_dir() and (d.name == QUARANTINE or NAMESPACE_RE.fullmatch(d.name)):
                    for name in os.listdir(d):
                        if (name.endswith(SUFFIX) and name not in keep) or d.name == QUARANTINE:
                            try:
                                os.unlink(d / name)
                            except OSError:
                                pass

    def gc(self) -> dict:
        """Delete quarantined files and temp files older than an hour (crashed writers)."""
        report = {"quarantine_removed": 0, "temp_removed": 0}
        qdir = self.root / QUARANTINE
        for p in qdir.iterdir() if qdir.exists() else ():
            p.unlink(missing_ok=True)
            report["quarantine_removed"] += 1
        for d in self.root.iterdir():
            if d.is_dir() and d.name != QUARANTINE:
                report["temp_removed"] += self._clean_stale_temps(d)
        return report

    def stats(self) -> dict:
        with self._lock:
            s = dict(self._stats)
            s["files"] = len(self._entries)
            s["bytes"] = sum(e.file_bytes for e in self._entries.values())
            s["kv_bytes"] = sum(e.raw_bytes for e in self._entries.values())
            s["budget_bytes"] = self.ssd_budget_bytes
            return s

