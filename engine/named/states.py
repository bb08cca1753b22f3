"""States a user reaches by name: named checkpoints (`eng.checkpoints`) and KV inspection
(`eng.kv`) of a session's, a named checkpoint's or the last generation's state.

Bringing a state back from SSD (`checkpoints.restore`, and `sessions.switch` in
chat/sessions.py) returns at once and reads in the background (cache/loading.py);
inspecting one (`kv.info`, `kv.export`) reads it now, sharing a read in progress.
"""

from __future__ import annotations

from typing import Callable

from ..cache.tiered import TieredPromptCache
from ..chat.sessions import Sessions
from ..events import EventBus
from ..kv import inspect as kv_inspect
from ..models.registry import ModelRegistry
from .checkpoints import CheckpointNameError, NamedCheckpoints, check_name


class StateFinder:
    """The cache entry a user means by session / checkpoint / last (the default)."""

    def __init__(self, cache: TieredPromptCache, names: NamedCheckpoints, sessions: Sessions,
                 last_key: Callable[[], tuple | None]):
        """last_key: the (namespace, tokens) of the last generation's checkpoint, or None."""
        self.cache, self.names, self.sessions, self.last_key = cache, names, sessions, last_key

    def entry(self, *, session=None, checkpoint=None, last=False, model=None):
        """Restored from SSD when it is no longer resident."""
        if (session is not None) + (checkpoint is not None) + bool(last) > 1:
            raise ValueError("choose one of session, checkpoint or last")
        if session is not None:
            return self.sessions.entry(session, model=model)
        if checkpoint is not None:
            record = self.names.get(checkpoint)
            ns, tokens = record["namespace"], tuple(record["tokens"])
        else:
            last = self.last_key()
            if last is None:
                raise ValueError("nothing generated yet: run a generation first")
            ns, tokens = last
        entry, _ = self.cache.restore_exact(tokens, ns)
        if entry is None:
            raise ValueError(f"the cached state of {checkpoint or 'the last generation'} is no longer in RAM or on SSD")
        return entry


class Checkpoints:
    """Named checkpoints (`eng.checkpoints`): save, restore, remove, list. A name pins its state in
    every process on the cache directory; the records (checkpoints.py) are the truth the catalogue's
    pins follow."""

    def __init__(self, *, cache: TieredPromptCache, names: NamedCheckpoints, sessions: Sessions,
                 models: ModelRegistry, events: EventBus, poll: Callable[[], None], find: StateFinder):
        """poll: apply finished background work (the engine's)."""
        self.cache, self.names, self.sessions, self.models, self.events = cache, names, sessions, models, events
        self.poll, self.find = poll, find
        catalog = cache.catalog  # who saves a name (the panel never removes a live kernel's names)
        self.saved_by = {"owner": catalog.owner, "pid": catalog.identity.pid, "host": catalog.identity.host} \
            if catalog is not None else None
        cache.follow_pins(lambda: {r["name"]: (r["namespace"], tuple(r["tokens"])) for r in names.list()})

    def save(self, name: str, *, session: str | None = None, model: str | None = None) -> dict:
        """Pin the session's latest (or the last generation's) checkpoint under a name, durably."""
        check_name(name)
        self.poll()
        entry = self.find.entry(session=session, model=model)
        m = self.models.by_namespace(entry.ns)
        s = self.sessions.get(session) if session else None
        # The record first: a process starting meanwhile pins what the records name.
        record = self.names.save(
            name,
            {
                "namespace": entry.ns,
                "model": m.name if m else None,
                "tokens": list(entry.tokens),
                "kv_bytes": entry.checkpoint.kv_bytes,
                "durable": self.cache.has_ssd,
                "session": s.record() if s else None,
                "preview": self.models.preview(entry.ns, entry.tokens),
                "saved_by": self.saved_by,
            },
        )
        if not self.cache.durability.pin(entry, name):
            self.names.remove(name)
            raise CheckpointNameError(f"could not write checkpoint {name!r} to SSD: {entry.write_error or 'write failed'}")
        self.cache.publish_remote(entry.tokens, entry.ns)  # with remote_publish=named, names go remote
        self.events.emit("checkpoint_saved", name=name, tokens=len(entry.tokens))
        return self._summary(record)

    def restore(self, name: str) -> dict:
        """Make a named checkpoint resident again and, for a session checkpoint, its chat history.

        A checkpoint on SSD only loads in the background: the call returns at
        once with source "loading", and the next generation that needs the
        state waits for that read (a lookup never reads a file twice).
        """
        record = self.names.get(name)
        ns, tokens = record["namespace"], tuple(record["tokens"])
        m = self.models.by_namespace(ns)
        if m is None:
            raise CheckpointNameError(
                f"checkpoint {name!r} belongs to a model that is not loaded"
                + (f" (it was saved from model {record['model']!r})" if record.get("model") else "")
            )
        session = record.get("session")

        def resident(entry) -> None:
            entry.pinned.add(name)
            if session:
                self.cache.bind_session(session["id"], entry)

        self.poll()
        source, _ = self.cache.load(tokens, ns, then=resident)
        if source is None:
            raise CheckpointNameError(f"checkpoint {name!r} is no longer in RAM or on SSD")
        if session:
            s = self.sessions.get_or_create(session["id"], system=session.get("system"), model=m.name)
            s.restore(session, tokens)
        self.events.emit("checkpoint_restored", name=name, tokens=len(tokens), source=source)
        return {**self._summary(record), "source": source}

    def remove(self, name: str) -> dict:
        """Remove the name (and its pin); the state stays cached like any other."""
        record = self.names.remove(name)
        ns, tokens = record["namespace"], tuple(record["tokens"])
        self.cache.durability.unpin(ns, tokens, name)
        return self._summary(record)

    def list(self) -> list[dict]:
        """Every name: its model, tokens, KV bytes, session, tier ("ram+ssd", "ssd", "missing" ...), preview."""
        return [self._summary(r) for r in self.names.list()]

    def _summary(self, record: dict) -> dict:
        ns, tokens = record["namespace"], tuple(record["tokens"])
        in_ram = self.cache.get_exact(tokens, ns) is not None
        on_ssd = self.cache.on_ssd(tokens, ns)
        return {
            "name": record["name"],
            "model": record.get("model"),
            "tokens": len(tokens),
            "kv_bytes": record.get("kv_bytes", record.get("bytes")),
            "session": (record.get("session") or {}).get("id"),
            "tier": "+".join(t for t, on in (("ram", in_ram), ("ssd", on_ssd)) if on) or "missing",
            "saved": record.get("saved"),
            "preview": self.models.preview(ns, tokens),
        }


class KVInspection:
    """The KV tensors of a state (`eng.kv`): session=ID, checkpoint=NAME or last=True (the default);
    layer=L for one layer. Reads the state now (from SSD if it is no longer resident)."""

    def __init__(self, find: StateFinder):
        self.find = find

    def info(self, *, session=None, checkpoint=None, last=False, layer=None) -> list[dict]:
        """Per-layer, per-array shapes, dtype, bytes, offset, hash prefix and value statistics."""
        entry = self.find.entry(session=session, checkpoint=checkpoint, last=last)
        return kv_inspect.kv_info(entry.checkpoint, layer)

    def export(self, *, session=None, checkpoint=None, last=False, layer=None) -> dict:
        """The KV tensors as numpy copies ('layer{i}.keys' ...); bfloat16 becomes float32."""
        entry = self.find.entry(session=session, checkpoint=checkpoint, last=last)
        return kv_inspect.kv_export(entry.checkpoint, layer)
