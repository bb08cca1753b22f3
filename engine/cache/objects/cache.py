"""Exact tensor objects on the prompt cache's tiers: `Engine.objects`.

The API (owner thread, like every Engine call)::

    eng.objects.put(key, value, label=None) -> bool   # False: not kept (bigger than RAM and no SSD)
    eng.objects.get(key, default=None)       # the value, or default: RAM, else SSD, else remote (verified)
    eng.objects.lookup(key) -> (value, "ram" | "ssd" | "remote") or (None, None)   # the same, saying where from
    eng.objects.where(key) -> "ram" | "ssd" | None      # where it is now, reading nothing
    eng.objects.delete(key) -> bool          # from RAM and SSD
    eng.objects.clear(label=None) -> int     # every object (or those with this label)
    eng.objects.entries() -> list[dict]      # one row per object, as eng.admin.entries() rows
    eng.objects.stats() -> dict              # the object_* keys of Engine.stats()

- **key**: str, bytes, int, float, bool, None, mx/numpy arrays (by dtype,
  shape and bytes), or tuples / lists / dicts of them; exact and typed
  (values.digest: BLAKE3, never a path). Build it from everything the value
  depends on, e.g. ("my-encoder", weights_id, revision, pixels, grid).
- **value**: an `mx.array`, a numpy array, or dicts / lists / tuples of them
  (numbers, strings, None, bools beside them). `get` returns the same kinds,
  dtypes (bfloat16 too), shapes and structure. MLX arrays come back as new
  array objects over immutable buffers; numpy arrays as **read-only views**
  (`np.array(x)` for a writable copy). Either stays valid after the object is
  evicted, replaced or deleted: the cache only drops its own reference.
- **label**: what listings show (`%cache ls`, `%memo ls`; memo uses
  "memo:<function>"); by default a str key itself, or the first element of a
  tuple key when it is a str. `clear(label)` removes one label's objects.

How it rides on the prompt cache (reference design 5.13): an object is a
checkpoint with no tokens and no KV layers (`ObjectValue`) in a private
namespace made of its key digest ("obj-" + 60 hex digits; model namespaces
are 24 hex digits), so it can never serve as a language-model prefix, and it
shares everything else with prefixes: the RAM budget and retention policy,
the memory-pressure guard, write-behind through the background writer,
persist-before-evict, the SSD catalogue (leases while reading, caps, gc,
quarantine) and BLAKE3 verification of every byte read. On SSD an object is
one manifest whose tensors are inline: each array's bytes in 4 MiB chunks,
each with its own BLAKE3, read and verified two at a time straight into the
MLX buffer of its array (benchmarks/bench_objects.py). The manifest's
identity holds the object revision, the full key digest and the label; its
layout holds the value's tree. Putting a key again replaces its value (RAM
and SSD) before the new one is queued, so a stale copy is never served.
With a remote tier (and remote_publish="all"), committed objects are
published there and a lookup that misses RAM and SSD reads it from there,
verified, then writes it through to SSD (remote.py).
"""

from __future__ import annotations

import time

from ..catalog.database import CatalogBusy
from ..durability import WriteState
from ..ssd.store import CheckpointUnavailable
from .naming import is_object_namespace, namespace_of  # noqa: F401 (callers' names)
from .stored import (FILE_KEY as _FILE_KEY, NO_TOKENS as _NO_TOKENS, REVISION, ObjectRead, ObjectValue)  # noqa: F401
from .values import describe, digest, flatten

LABEL_MAX = 200
REMOVE_WAIT_S = 1.0  # a put or delete waits this long at most for another process's read of the old file
COUNTERS = ("object_puts", "object_put_bytes", "object_ram_hits", "object_ssd_hits", "object_remote_hits",
            "object_misses", "object_restore_failures", "object_restore_bytes", "object_restore_seconds")



def _servable(handle, key_digest: str) -> bool:
    """Whether an SSD index entry holds this key's object in this build's revision."""
    ident = handle.identity if handle is not None else None
    return isinstance(ident, dict) and ident.get("object") == REVISION and ident.get("key") == key_digest


def _label(key, label) -> str:
    if label is None:
        first = key[0] if isinstance(key, (tuple, list)) and key else key
        label = first if isinstance(first, str) else ""
        label = label[:LABEL_MAX]
    if not isinstance(label, str) or len(label) > LABEL_MAX:
        raise ValueError(f"an object label is a str of at most {LABEL_MAX} characters")
    return label


class ObjectCache:
    """Exact-key objects over a TieredPromptCache (see the module docstring)."""

    def __init__(self, cache, check_open=lambda: None):
        self.cache = cache
        self._check_open = check_open  # raises once the engine is closed
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.counters["object_restore_seconds"] = 0.0

    # --- the API ---

    def get(self, key, default=None):
        """The value stored under `key` (RAM, else SSD), or `default`."""
        value, source = self.lookup(key)
        return default if source is None else value

    def lookup(self, key) -> tuple:
        """(value, where it came from: "ram" | "ssd" | "remote"), or (None, None) on a miss."""
        self._check_open()
        d = digest(key)
        ns = namespace_of(d)
        entry = self.cache.get_exact(_NO_TOKENS, ns)
        if entry is not None:
            entry.touch()
            entry.hits += 1
            self.cache.retention.hit(entry)
            self.counters["object_ram_hits"] += 1
            self._emit("object_hit", ns, source="ram", nbytes=entry.nbytes)
            return entry.checkpoint.value(), "ram"
        cp, source = self._read(ns, d), "ssd"
        if cp is None and self.cache.remote is not None:
            cp, source = self._fetch_remote(ns, d), "remote"
        if cp is None:
            self.counters["object_misses"] += 1
            self._emit("object_miss", ns)
            return None, None
        return cp.value(), source

    def put(self, key, value, *, label: str | None = None) -> bool:
        """Store `value` under `key`, replacing any value it had; False when it could not be kept
        (larger than the whole RAM budget with no SSD tier)."""
        self._check_open()
        d = digest(key)
        label = _label(key, label)
        tree, leaves = flatten(value)
        ns = namespace_of(d)
        self.cache.poll()
        self._remove(ns)
        if self.cache.remote is not None:  # a value put here is this member's own, whoever wrote the last
            self.cache.remote.origins.discard(ns, _NO_TOKENS)
        self._register(ns, {"object": REVISION, "key": d, "label": label})
        if self.cache.pressure is not None:
            self.cache.pressure.check("object")
        cp = ObjectValue.of(tree, leaves)
        entry = self.cache.put(cp, ns)
        self.counters["object_puts"] += 1
        self.counters["object_put_bytes"] += cp.nbytes
        self._emit("object_put", ns, nbytes=cp.nbytes, label=label)
        return entry is not None or self.cache.store is not None

    def where(self, key) -> str | None:
        """Where `key`'s value is now ("ram", "ssd") or None, from the indexes alone (no read)."""
        d = digest(key)
        ns = namespace_of(d)
        if self.cache.get_exact(_NO_TOKENS, ns) is not None:
            return "ram"
        return "ssd" if _servable(self._file(ns), d) else None

    def delete(self, key) -> bool:
        """Remove the object from RAM and SSD; whether there was one."""
        self._check_open()
        self.cache.poll()
        return self._remove(namespace_of(digest(key)))

    def clear(self, label: str | None = None) -> int:
        """Remove every object (or every object with this label) from RAM and SSD; how many."""
        self._check_open()
        self.cache.poll()
        labels = {h.namespace: h.identity.get("label") for h in self._files()}
        labels.update({e.ns: self.cache.identities.get(e.ns, {}).get("label")
                       for e in self.cache.entries() if is_object_namespace(e.ns)})
        chosen = sorted(ns for ns, lb in labels.items() if label is None or lb == label)
        for ns in chosen:
            self._drop_ram(ns, "cleared")
        if self.cache.store is not None and chosen:  # a few files per transaction
            self.cache.store.remove([(ns, _FILE_KEY) for ns in chosen], reason="cleared")
        return len(chosen)

    def entries(self) -> list[dict]:
        """One row per object (RAM and SSD), newest first: eng.admin.entries() rows."""
        rows = [self.row(r) for r in self.cache.rows() if is_object_namespace(r["ns"])]
        return sorted(rows, key=lambda r: -(r["last_used"] or 0))

    def stats(self) -> dict:
        ram = [e for e in self.cache.entries() if is_object_namespace(e.ns)]
        files = self._files()
        return {
            **self.counters,
            "object_ram_entries": len(ram),
            "object_ram_bytes": sum(e.nbytes for e in ram),
            "object_ssd_files": len(files),
            "object_ssd_bytes": sum(h.file_bytes for h in files),
        }

    # --- rows ---

    def label(self, ns: str) -> str | None:
        ident = self.cache.identities.get(ns)
        if ident is None:
            h = self._file(ns)
            ident = h.identity if h is not None else {}
        return ident.get("label")

    def row(self, row: dict) -> dict:
        """A cache.rows() row of an object, as eng.admin.entries() shows it."""
        row = dict(row)
        ns = row.pop("ns")
        row.pop("tokens", None)
        entry = self.cache.get_exact(_NO_TOKENS, ns)
        what = describe(entry.checkpoint.tree) if entry is not None else "on SSD"
        label = self.label(ns)
        return {"kind": "object", "model": None, "namespace": ns, "tokens": None, "label": label,
                "preview": f"{label or 'object ' + ns[4:16]} · {what}", "pinned": [], **row}

    # --- internals ---

    def _emit(self, kind: str, ns: str, **fields) -> None:
        self.cache.emit(kind, ns=ns, **fields)

    def _register(self, ns: str, identity: dict) -> None:
        if self.cache.identities.get(ns) != identity:
            self.cache.register_namespace(ns, identity, check=False)

    def _file(self, ns: str):
        store = self.cache.store
        if store is None:
            return None
        store.sync()
        with store.index.lock:
            return store.index.entries.get((ns, _FILE_KEY))

    def _files(self) -> list:
        store = self.cache.store
        if store is None:
            return []
        store.sync()
        with store.index.lock:
            return [h for (ns, _), h in store.index.entries.items() if is_object_namespace(ns)]

    def _read(self, ns: str, d: str) -> ObjectValue | None:
        """Read the object's SSD file (verified) and publish it in RAM; None on a miss."""
        handle = self._file(ns)
        if not _servable(handle, d):
            return None  # none, or another revision's (replaced by the next put)
        ident = handle.identity
        self._register(ns, ident)
        if self.cache.pressure is not None:
            self.cache.pressure.check("lookup")
        t0 = time.perf_counter()
        try:
            pending = self.cache.store.open_read(handle)
            read = ObjectRead(pending.header)
            pending.allocate(read.allocate)
            pending.fill()
            cp = pending.finish(read.build)
        except CheckpointUnavailable as e:
            self.counters["object_restore_failures"] += 1
            self._emit("restore_failed", ns, reason=str(e), label=ident.get("label"))
            return None
        seconds = time.perf_counter() - t0
        entry = self.cache.put(cp, ns, evict=False, defer_write=True)  # read back: durable already
        if entry is not None:
            entry.write_state, entry.restored = WriteState.COMMITTED, True
        self.cache.ram.enforce_budget()
        self.counters["object_ssd_hits"] += 1
        self.counters["object_restore_bytes"] += cp.nbytes
        self.counters["object_restore_seconds"] += seconds
        self._emit("object_hit", ns, source="ssd", nbytes=cp.nbytes, seconds=seconds)
        return cp

    def _fetch_remote(self, ns: str, d: str) -> ObjectValue | None:
        """Read the object from the remote tier, publish it in RAM and write it through to SSD."""
        from . import remote as object_remote

        t0 = time.perf_counter()
        try:
            found = object_remote.fetch(self.cache.remote.tier, ns, d, REVISION)
        except Exception as e:  # noqa: BLE001 - the remote tier never fails a cell: a miss
            self.counters["object_restore_failures"] += 1
            self._emit("restore_failed", ns, source="remote", reason=f"{type(e).__name__}: {str(e)[:200]}")
            return None
        if found is None:
            return None
        tree, leaves, label, rec = found
        self._register(ns, {"object": REVISION, "key": d, "label": label})
        cp = ObjectValue.of(tree, leaves)
        # Its writer, before its write-through commits: revoked, it leaves the SSD; never republished as ours.
        self.cache.remote.origins.add(ns, _NO_TOKENS, rec.writer, rec.key_id)
        self.cache.put(cp, ns)  # dirty: write-behind stores it on this machine's SSD
        seconds = time.perf_counter() - t0
        self.counters["object_remote_hits"] += 1
        self.counters["object_restore_bytes"] += cp.nbytes
        self._emit("object_hit", ns, source="remote", nbytes=cp.nbytes, seconds=seconds)
        return cp

    def _remove(self, ns: str) -> bool:
        """Drop the object's RAM entry and its SSD file (waiting a moment for another process's read)."""
        found = self._drop_ram(ns, "replaced")
        if self._file(ns) is None:
            return found
        deadline = time.monotonic() + REMOVE_WAIT_S
        while True:
            try:
                if self.cache.store.remove([(ns, _FILE_KEY)], reason="replaced"):
                    break
            except CatalogBusy:  # another process holds the catalogue: wait a little, as for a lease
                pass
            if self._file(ns) is None or time.monotonic() > deadline:  # gone, or another process reads it
                break
            time.sleep(0.02)
        return True

    def _drop_ram(self, ns: str, reason: str) -> bool:
        """Drop the object's RAM entry, stopping its queued or running write (of the old value)."""
        cache = self.cache
        entry = cache.get_exact(_NO_TOKENS, ns)
        if entry is None:
            return False
        key = (ns, _NO_TOKENS)
        if entry.write_state == WriteState.PENDING:
            if cache.writer.cancel(key):
                cache.counters["writes_cancelled"] += 1
            elif not cache.writer.abort(key, REMOVE_WAIT_S):
                cache.writer.wait_written(key, 30.0)  # past its last pause (a slow fsync): let it end
        cache.durability.drain_completions()  # before a new value's entry exists: this completion is the old one's
        cache.ram.remove(entry, reason=reason)
        return True
