"""States a user names: named checkpoints, chat sessions' states and KV inspection.

`Engine` holds one `UserStates` and hands its public calls on (engine.py).

Bringing a state back from SSD (`checkpoint_restore`, `session_switch`)
returns at once and reads in the background (cache/loading.py); inspecting
one (`kv_info`, `kv_export`) reads it now, sharing a read in progress.
"""

from __future__ import annotations

from typing import Callable

from ..cache.tiered import TieredPromptCache
from ..events import EventBus
from ..kv import inspect as kv_inspect
from ..models.registry import ModelRegistry
from .checkpoints import CheckpointNameError, NamedCheckpoints, check_name
from ..chat.sessions import Sessions


class UserStates:
    def __init__(self, *, cache: TieredPromptCache, names: NamedCheckpoints, sessions: Sessions,
                 models: ModelRegistry, events: EventBus, poll: Callable[[], None],
                 last_key: Callable[[], tuple | None]):
        """poll: apply finished background work (the engine's); last_key: the (namespace, tokens)
        of the last generation's checkpoint, or None."""
        self.cache, self.names, self.sessions, self.models, self.events = cache, names, sessions, models, events
        self.poll, self.last_key = poll, last_key
        catalog = cache.catalog  # who saves a name (the panel never removes a live kernel's names)
        self.saved_by = {"owner": catalog.owner, "pid": catalog.identity.pid, "host": catalog.identity.host} \
            if catalog is not None else None

    def close_session(self, session_id: str) -> None:
        """Forget a chat session and its cache references; the cached state stays."""
        self.sessions.close(session_id)
        self.cache.drop_session(session_id)

    def resolve_entry(self, *, session=None, checkpoint=None, last=False, model=None):
        """The cache entry a user means by --session / --checkpoint / --last (the default).

        Restored from SSD when it is no longer resident.
        """
        if (session is not None) + (checkpoint is not None) + bool(last) > 1:
            raise ValueError("choose one of session, checkpoint or last")
        if checkpoint is not None:
            record = self.names.get(checkpoint)
            ns, tokens = record["namespace"], tuple(record["tokens"])
        elif session is not None:
            s = self.sessions.get(session)
            ns = self.models.get(s.model or model).namespace
            entry = self.cache.session_entry(session, ns)
            if entry is None and self.cache.loading.reader is not None and self.cache.loading.reader.jobs():
                self.cache.loading.wait_reads(30)  # a `session_switch` may be loading it
                entry = self.cache.session_entry(session, ns)
            if entry is None:
                raise ValueError(f"session {session!r} has no cached state yet: generate in it first")
            return entry
        else:
            last = self.last_key()
            if last is None:
                raise ValueError("nothing generated yet: run a generation first")
            ns, tokens = last
        entry, _ = self.cache.restore_exact(tokens, ns)
        if entry is None:
            raise ValueError(f"the cached state of {checkpoint or 'the last generation'} is no longer in RAM or on SSD")
        return entry

    def checkpoint_save(self, name: str, *, session: str | None = None, model: str | None = None) -> dict:
        """Pin the session's latest (or the last generation's) checkpoint under a name, durably."""
        check_name(name)
        self.poll()
        entry = self.resolve_entry(session=session, model=model)
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
                "session": {"id": s.id, "system": s.system, "messages": s.messages} if s else None,
                "preview": self.models.preview(entry.ns, entry.tokens),
                "saved_by": self.saved_by,
            },
        )
        if not self.cache.durability.pin(entry, name):
            self.names.remove(name)
            raise CheckpointNameError(f"could not write checkpoint {name!r} to SSD: {entry.write_error or 'write failed'}")
        self.cache.publish_remote(entry.tokens, entry.ns)  # with remote_publish=named, names go remote
        self.events.emit("checkpoint_saved", name=name, tokens=len(entry.tokens))
        return self._named_summary(record)

    def checkpoint_restore(self, name: str) -> dict:
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
            s.system, s.messages = session.get("system"), [dict(x) for x in session["messages"]]
            s.last_prompt_tokens = len(tokens)
            s.history = [(list(tokens), None)]  # the next turn keeps these ids where the text matches
        self.events.emit("checkpoint_restored", name=name, tokens=len(tokens), source=source)
        return {**self._named_summary(record), "source": source}

    def session_switch(self, session_id: str, *, model: str | None = None) -> dict:
        """Bring a chat session's latest state back into RAM, in the background when it is on
        SSD only; returns at once: {"session", "tokens", "source": "ram" | "loading" | None}."""
        s = self.sessions.get(session_id)
        ns = self.models.get(s.model or model).namespace
        entry = self.cache.session_entry(s.id, ns)
        if entry is not None:
            return {"session": s.id, "tokens": len(entry.tokens), "source": "ram"}
        ids = s.history[0][0] if s.history else []
        if not ids:
            return {"session": s.id, "tokens": 0, "source": None}
        self.poll()
        source, n = self.cache.load(ids, ns, exact=False, then=lambda e: self.cache.bind_session(s.id, e))
        self.events.emit("session_switched", session=s.id, tokens=n, source=source)
        return {"session": s.id, "tokens": n if source else 0, "source": source}

    def checkpoint_remove(self, name: str) -> dict:
        record = self.names.remove(name)
        ns, tokens = record["namespace"], tuple(record["tokens"])
        self.cache.durability.unpin(ns, tokens, name)
        return self._named_summary(record)

    def checkpoint_list(self) -> list[dict]:
        return [self._named_summary(r) for r in self.names.list()]

    def _named_summary(self, record: dict) -> dict:
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

    def kv_info(self, *, session=None, checkpoint=None, last=False, layer=None) -> list[dict]:
        """Per-layer, per-array shapes, dtype, bytes, offset, hash prefix and value statistics."""
        entry = self.resolve_entry(session=session, checkpoint=checkpoint, last=last)
        return kv_inspect.kv_info(entry.checkpoint, layer)

    def kv_export(self, *, session=None, checkpoint=None, last=False, layer=None) -> dict:
        """The KV tensors as numpy copies ('layer{i}.keys' ...); bfloat16 becomes float32."""
        entry = self.resolve_entry(session=session, checkpoint=checkpoint, last=last)
        return kv_inspect.kv_export(entry.checkpoint, layer)
