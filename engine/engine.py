"""The Engine facade: models, the tiered prompt cache, sessions and generation.

All MLX work happens on the thread that calls the engine (the owner). The
SSD writer runs beside it on numpy views and reports back through `poll()`,
which every public call drains first.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from . import blas, kv_inspect
from .checkpoint import Checkpoint
from .events import EventBus
from .generation import DecodeResult, GenerationError, SamplingParams, TextStream, decode, prefill
from .inflight import InflightRecords, request_id
from .models import IdentityMemo, LoadedModel, ModelRegistry
from .named import CheckpointNameError, NamedCheckpoints, check_name
from .sessions import Sessions
from .storage.store import token_key
from .tiered import TieredPromptCache

DEFAULT_PREFILL_CHUNK = 512
TRIMMABLE_CACHES = ("KVCache", "QuantizedKVCache")  # mlx-lm classes that can always be cut back


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlxcache-kernel"


def default_ram_budget() -> int:
    """A quarter of physical memory: room for the model, the notebook and the OS."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.25)
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def make_private_dir(path: Path) -> Path:
    """Create (or tighten) a directory readable by its owner only: it holds prompts."""
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


@dataclass
class GenerationResult:
    text: str
    tokens: list
    stats: dict
    prompt_tokens: list = field(default_factory=list, repr=False)

    def __str__(self) -> str:
        return self.text


class _InflightBoundary:
    """Queues an in-flight checkpoint every `every` emitted tokens (owner thread)."""

    def __init__(self, engine: "Engine", m: LoadedModel, rid: str, tokens: list, emitted: list, every: int):
        self.engine, self.m, self.rid, self.tokens, self.every = engine, m, rid, tokens, every
        self.emitted = list(emitted)

    def maybe_capture(self, caches, token: int) -> None:
        self.emitted.append(token)
        k = len(self.emitted)
        cache = self.engine.cache
        if k % self.every or cache.writer is None:
            return
        # The caches already hold emitted[-1] (decode runs one step ahead):
        # cut them at the boundary where emitted[-1] is still pending.
        boundary = self.tokens + self.emitted[:-1]
        cp = Checkpoint.capture(boundary, caches, copy=True, length=len(boundary))
        record = {
            "namespace": self.m.namespace,
            "prompt_tokens": len(self.tokens),
            "emitted": list(self.emitted),
            "boundary_key": token_key(boundary),
        }
        inflight, rid = self.engine.inflight, self.rid
        cache.queue_inflight(cp, self.m.namespace, on_commit=lambda info: inflight.write(rid, record))


class Engine:
    def __init__(
        self,
        cache_dir: str | os.PathLike | None = None,
        ram_budget_bytes: int | None = None,
        ssd_budget_bytes: int | None = None,
        *,
        ssd: bool = True,
        write_behind: bool = True,
        idle_demote_s: float | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ):
        self.cache_dir = make_private_dir(cache_dir or default_cache_dir())
        self.events = EventBus()
        self.models = ModelRegistry(IdentityMemo(self.cache_dir / "identities.json"))
        self.sessions = Sessions()
        self.prefill_chunk = int(prefill_chunk)
        self.cache = TieredPromptCache(
            ram_budget_bytes=default_ram_budget() if ram_budget_bytes is None else int(ram_budget_bytes),
            ssd_dir=self.cache_dir / "checkpoints" if ssd else None,
            ssd_budget_bytes=ssd_budget_bytes,
            write_behind=write_behind,
            idle_demote_s=idle_demote_s,
            emit=self.events.emit,
        )
        self.counters = {
            "generations": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "ram_tokens": 0,
            "ssd_tokens": 0,
            "prefilled_tokens": 0,
            "prefill_s": 0.0,
            "prefill_s_saved": 0.0,
            "decode_tokens": 0,
        }
        self.last_result: GenerationResult | None = None
        self._last_key: tuple | None = None  # (namespace, tokens) of the last generation's checkpoint
        self.names = NamedCheckpoints(self.cache_dir / "names")
        self.inflight = InflightRecords(self.cache_dir / "inflight")
        if self.cache.store is not None:
            for ns, tokens in self.names.pinned_keys():
                self.cache.store.protect(ns, tokens)
        self._previews: dict = {}
        self._prefill_rate: dict = {}  # namespace -> measured prefill tokens/s
        self._closed = False

    # --- models ---

    def load_model(self, path_or_id, name: str = "default") -> dict:
        loaded = self.models.load(path_or_id, name)
        self.cache.register_namespace(loaded.namespace, loaded.identity)
        self.events.emit("model_loaded", name=name, path=str(loaded.path), namespace=loaded.namespace)
        return self.model_info(name)

    def unload_model(self, name: str) -> None:
        self.models.unload(name)
        self.events.emit("model_unloaded", name=name)

    def model_info(self, name: str | None = None) -> dict:
        m = self.models.get(name)
        return {"name": m.name, "namespace": m.namespace, "identity": dict(m.identity), **m.info}

    # --- prompts ---

    def encode_prompt(
        self,
        prompt: str,
        *,
        model: str | None = None,
        system: str | None = None,
        raw: bool = False,
        session: str | None = None,
    ) -> list[int]:
        m = self.models.get(model)
        if not isinstance(prompt, str) or not prompt.strip():
            raise GenerationError("empty prompt: write the prompt in the cell (or pass a non-empty string)")
        tok = m.tokenizer
        if raw:
            bos = getattr(tok, "bos_token", None)
            return list(tok.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos))))
        if session is not None:
            messages = self.sessions.get_or_create(session, system=system, model=m.name).render_messages(
                prompt, system
            )
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return list(tok.encode(text, add_special_tokens=False))
        return list(tok.encode("\n".join(msg["content"] for msg in messages)))

    # --- generation ---

    def generate(
        self,
        prompt: str,
        max_tokens: int = 256,
        temperature: float = 0.0,
        seed: int = 0,
        session: str | None = None,
        model: str | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: Sequence[str] = (),
        system: str | None = None,
        raw: bool = False,
        use_cache: bool = True,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[str, int, int], None] | None = None,
        checkpoint_every: int | None = None,
    ) -> GenerationResult:
        self._check_open()
        self.poll()
        params = SamplingParams(max_tokens, float(temperature), float(top_p), int(top_k), seed, tuple(stop))
        m = self.models.get(model)
        params.validate(_vocab_size(m))
        tokens = self.encode_prompt(prompt, model=m.name, system=system, raw=raw, session=session)
        result = self.generate_tokens(
            tokens, params, model=m.name, session=session, use_cache=use_cache, on_text=on_text,
            on_progress=on_progress, checkpoint_every=checkpoint_every,
        )
        if session is not None:
            self.sessions.get(session).record_turn(prompt, result.text, len(tokens))
        return result

    def generate_tokens(
        self,
        tokens: Sequence[int],
        params: SamplingParams,
        *,
        model: str | None = None,
        session: str | None = None,
        use_cache: bool = True,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[str, int, int], None] | None = None,
        checkpoint_every: int | None = None,
    ) -> GenerationResult:
        """Generate from prompt token ids: resume or cache lookup, prefill, decode, publish."""
        self._check_open()
        m = self.models.get(model)
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise GenerationError("empty prompt: no tokens to generate from")
        params.validate(_vocab_size(m))
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
            raise GenerationError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}")
        ns = m.namespace
        if hasattr(mx, "reset_peak_memory"):
            mx.reset_peak_memory()
        t0 = time.perf_counter()
        rid = request_id(ns, tokens, params.as_dict())
        self.inflight.start(rid)
        resumed = self._resume_lease(rid, tokens, ns) if use_cache else None
        emitted: list[int] = resumed[1] if resumed else []
        lease = resumed[0] if resumed else None
        if lease is None and use_cache:
            # move=True: an entry this generation will supersede hands over its buffers
            lease = self.cache.take(tokens, ns, session=session, progress=on_progress, move=True)
        caches = lease.caches if lease else make_prompt_cache(m.model)
        cached = min(lease.length, len(tokens)) if lease else 0
        source = lease.source if lease else None
        t_lookup = time.perf_counter() - t0
        boundary = _InflightBoundary(self, m, rid, tokens, emitted, checkpoint_every) if checkpoint_every else None
        decoded = DecodeResult()
        try:
            with self.cache.generating():
                t1 = time.perf_counter()
                suffix = [] if emitted else tokens[cached:-1]
                if suffix:
                    prefill(
                        m.model,
                        caches,
                        suffix,
                        chunk=self.prefill_chunk,
                        progress=(lambda done, total: on_progress("prefill", done, total)) if on_progress else None,
                    )
                prefill_s = time.perf_counter() - t1
                stream, times = self._decode(
                    m, caches, tokens, emitted, params, ns, use_cache, on_text, t0, boundary, decoded
                )
        except BaseException:
            # Keep what was computed (a rerun continues from there), also the
            # state a moved entry handed over. The in-flight record stays.
            if use_cache:
                try:
                    self._publish_interrupted(tokens + emitted + decoded.tokens, caches, ns, session)
                except Exception:
                    pass  # never mask the original error
            raise
        finally:
            if lease:
                lease.release()
        self.inflight.finish(rid)  # completion invalidates the resume point
        if use_cache:
            final = tokens + decoded.tokens[: len(emitted) + decoded.forwarded]
            entry = self.cache.put(Checkpoint.capture(final, caches), ns, session=session, prompt_tokens=len(tokens))
            self._last_key = (ns, tuple(final)) if entry is not None else self._last_key
            self.cache.queue_dirty()  # the prompt snapshot too, unless the final one superseded it
        del caches
        forwarded = len(suffix) + (0 if emitted else 1)  # the last prompt token goes in with the first decode step
        stats = self._stats_for(ns, tokens, cached, source, forwarded, prefill_s, t_lookup, decoded, times)
        stats["resumed_from"] = len(emitted) or None
        self.last_result = GenerationResult(stream.text, decoded.tokens, stats, list(tokens))
        self.events.emit("generation", **{k: v for k, v in stats.items() if not isinstance(v, (list, dict))})
        return self.last_result

    def _resume_lease(self, rid: str, tokens: list, ns: str):
        """(lease at the in-flight boundary, emitted tokens) for an interrupted identical request."""
        record = self.inflight.load(rid)
        if record is None:
            return None
        emitted = record["emitted"]
        boundary = tuple(tokens) + tuple(emitted[:-1])
        entry, source = self.cache.restore_exact(boundary, ns)
        if entry is None:
            self.events.emit("resume_failed", request=rid, reason="boundary checkpoint not found")
            return None
        self.events.emit("resume", request=rid, emitted=len(emitted), source=source)
        return self.cache._lend(entry, len(boundary), source), list(emitted)

    def _publish_interrupted(self, known: list, caches: list, ns: str, session: str | None) -> None:
        """Publish the state an interrupted generation reached (prefill or decode).

        An interrupt can land between layers, so the caches are cut back to
        the shortest layer and to the tokens known to be in them. Only for
        caches that can be cut (plain and quantized KV).
        """
        if not caches or not all(type(c).__name__ in TRIMMABLE_CACHES for c in caches):
            return
        n = min(min(c.offset for c in caches), len(known))
        if n < 1:
            return
        for c in caches:
            c.trim(c.offset - n)
        self.cache.put(Checkpoint.capture(known[:n], caches), ns, session=session)
        self.cache.queue_dirty()
        self.events.emit("interrupted", ns=ns, tokens=n)

    def _decode(self, m: LoadedModel, caches, tokens, emitted, params, ns, use_cache, on_text, t0, boundary, decoded):
        stream = TextStream(m.tokenizer, params.stop)
        for token in emitted:  # a resumed generation shows what it had already said
            piece = stream.add(token)
            if piece and on_text:
                on_text(piece)
        times: list[float] = []
        # Plain KV caches can always be cut back, so the final checkpoint (or
        # the interrupted one) covers the prompt; others (a rotating window
        # that may wrap) need the prompt boundary published on its own.
        snapshot_needed = (
            use_cache
            and not emitted
            and not all(type(c).__name__ in TRIMMABLE_CACHES for c in caches)
            and self.cache.get_exact(tokens, ns) is None
        )

        def on_token(token: int, step: int) -> bool:
            times.append(time.perf_counter())
            if step == 0 and snapshot_needed:
                # The prompt boundary, so the next turn reuses the prompt even
                # when the generated text re-tokenizes differently (taken before
                # on_text, which may raise KeyboardInterrupt). A copy: this
                # generation keeps appending to its own buffers.
                snapshot = Checkpoint.capture(tokens, caches, copy=True, length=len(tokens))
                self.cache.put(snapshot, ns, defer_write=True)
            piece = stream.add(token)
            if piece and on_text:
                on_text(piece)
            if boundary is not None and not stream.stopped:
                boundary.maybe_capture(caches, token)
            return stream.stopped

        pending = emitted[-1:] if emitted else tokens[-1:]
        decode(
            m.model, caches, pending, params,
            eos_ids=m.eos_token_ids, first_step=len(emitted), on_token=on_token, into=decoded,
        )
        if len(times) < len(decoded.tokens):  # the eos token is not passed to on_token
            times.append(time.perf_counter())
        decoded.tokens = list(emitted) + decoded.tokens
        tail = stream.finish()
        if tail and on_text:
            on_text(tail)
        return stream, (t0, times)

    def _stats_for(self, ns, tokens, cached, source, prefilled, prefill_s, lookup_s, decoded, times) -> dict:
        t0, token_times = times
        ttft = token_times[0] - t0 if token_times else None
        n = len(token_times)
        decode_tps = (n - 1) / (token_times[-1] - token_times[0]) if n > 1 and token_times[-1] > token_times[0] else None
        stats = {
            "prompt_tokens": len(tokens),
            "cached_tokens": cached,
            "cache_source": source,
            "ram_tokens": cached if source == "ram" else 0,
            "ssd_tokens": cached if source == "ssd" else 0,
            "prefilled_tokens": prefilled,
            "lookup_s": lookup_s,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": (prefilled / prefill_s) if prefilled and prefill_s > 0 else None,
            "ttft_s": ttft,
            "decode_tokens": len(decoded.tokens),
            "decode_tokens_per_s": decode_tps,
            "total_s": (token_times[-1] - t0) if token_times else None,
            "finish_reason": decoded.finish_reason,
            "peak_memory_bytes": int(mx.get_peak_memory()) if hasattr(mx, "get_peak_memory") else None,
        }
        c = self.counters
        c["generations"] += 1
        c["prompt_tokens"] += len(tokens)
        c["cached_tokens"] += cached
        c["ram_tokens"] += stats["ram_tokens"]
        c["ssd_tokens"] += stats["ssd_tokens"]
        c["prefilled_tokens"] += prefilled
        c["prefill_s"] += prefill_s
        c["decode_tokens"] += len(decoded.tokens)
        if prefilled >= 16 and prefill_s > 0:  # a real prefill: update this model's measured rate
            rate = prefilled / prefill_s
            old = self._prefill_rate.get(ns)
            self._prefill_rate[ns] = rate if old is None else 0.7 * old + 0.3 * rate
        if cached and self._prefill_rate.get(ns):
            c["prefill_s_saved"] += cached / self._prefill_rate[ns]
        return stats

    # --- cache control ---

    def poll(self) -> None:
        """Apply finished background work (owner thread)."""
        self.cache.poll()

    def flush(self, timeout: float | None = None) -> dict:
        """Wait until every queued write is durable; returns a report."""
        return self.cache.flush(timeout=timeout)

    def wait_for_writes(self, timeout: float | None = None) -> dict:
        """Wait for writes already queued, from any thread (touches no MLX, queues nothing)."""
        writer = self.cache.writer
        if writer is None:
            return {"committed": 0, "pending": 0}
        before = writer.pending()[0]
        writer.wait(None if timeout is None else max(timeout, 0.0))
        pending = writer.pending()[0]
        return {"committed": max(before - pending, 0), "pending": pending}

    def stats(self) -> dict:
        """Plain numbers; never touches MLX arrays."""
        return {
            "blas": blas.active_blas(),
            "models": self.models.names(),
            "default_model": self.models.default,
            "sessions": len(self.sessions.list()),
            "cache_dir": str(self.cache_dir),
            **{f"engine_{k}": v for k, v in self.counters.items()},
            **self.cache.stats(),
        }

    # --- sessions, named checkpoints, inspection ---

    def close_session(self, session_id: str) -> None:
        """Forget a chat session and its cache references; the cached state stays."""
        self.sessions.close(session_id)
        self.cache.drop_session(session_id)

    def _model_for_namespace(self, ns: str) -> LoadedModel | None:
        return next((self.models.get(n) for n in self.models.names() if self.models.get(n).namespace == ns), None)

    def _resolve_entry(self, *, session=None, checkpoint=None, last=False, model=None):
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
            if entry is None:
                raise ValueError(f"session {session!r} has no cached state yet: generate in it first")
            return entry
        else:
            if self._last_key is None:
                raise ValueError("nothing generated yet: run a generation first")
            ns, tokens = self._last_key
        entry, _ = self.cache.restore_exact(tokens, ns)
        if entry is None:
            raise ValueError(f"the cached state of {checkpoint or 'the last generation'} is no longer in RAM or on SSD")
        return entry

    def checkpoint_save(self, name: str, *, session: str | None = None, model: str | None = None) -> dict:
        """Pin the session's latest (or the last generation's) checkpoint under a name, durably."""
        check_name(name)
        self.poll()
        entry = self._resolve_entry(session=session, model=model)
        entry.pinned.add(name)
        store = self.cache.store
        if store is not None:
            store.protect(entry.ns, entry.tokens)
            durable = self.cache.persist(entry)
            if not durable:
                entry.pinned.discard(name)
                store.protect(entry.ns, entry.tokens, on=False)
                raise CheckpointNameError(
                    f"could not write checkpoint {name!r} to SSD: {entry.write_error or 'write failed'}"
                )
        m = self._model_for_namespace(entry.ns)
        s = self.sessions.get(session) if session else None
        record = self.names.save(
            name,
            {
                "namespace": entry.ns,
                "model": m.name if m else None,
                "tokens": list(entry.tokens),
                "kv_bytes": entry.checkpoint.kv_bytes,
                "durable": store is not None,
                "session": {"id": s.id, "system": s.system, "messages": s.messages} if s else None,
            },
        )
        self.events.emit("checkpoint_saved", name=name, tokens=len(entry.tokens))
        return self._named_summary(record)

    def checkpoint_restore(self, name: str) -> dict:
        """Make a named checkpoint resident again and, for a session checkpoint, its chat history."""
        record = self.names.get(name)
        ns, tokens = record["namespace"], tuple(record["tokens"])
        m = self._model_for_namespace(ns)
        if m is None:
            raise CheckpointNameError(
                f"checkpoint {name!r} belongs to a model that is not loaded"
                + (f" (it was saved from model {record['model']!r})" if record.get("model") else "")
            )
        entry, source = self.cache.restore_exact(tokens, ns)
        if entry is None:
            raise CheckpointNameError(f"checkpoint {name!r} is no longer in RAM or on SSD")
        entry.pinned.add(name)
        session = record.get("session")
        if session:
            s = self.sessions.get_or_create(session["id"], system=session.get("system"), model=m.name)
            s.system, s.messages = session.get("system"), [dict(x) for x in session["messages"]]
            s.last_prompt_tokens = len(tokens)
            self.cache.bind_session(s.id, entry)
        self.events.emit("checkpoint_restored", name=name, tokens=len(tokens), source=source)
        return {**self._named_summary(record), "source": source}

    def checkpoint_remove(self, name: str) -> dict:
        record = self.names.remove(name)
        ns, tokens = record["namespace"], tuple(record["tokens"])
        entry = self.cache.get_exact(tokens, ns)
        if entry is not None:
            entry.pinned.discard(name)
        still_named = (ns, tokens) in self.names.pinned_keys()
        if self.cache.store is not None and not still_named:
            self.cache.store.protect(ns, tokens, on=False)
        return self._named_summary(record)

    def checkpoint_list(self) -> list[dict]:
        return [self._named_summary(r) for r in self.names.list()]

    def _named_summary(self, record: dict) -> dict:
        ns, tokens = record["namespace"], tuple(record["tokens"])
        in_ram = self.cache.get_exact(tokens, ns) is not None
        on_ssd = self.cache.store is not None and self.cache.store.contains(tokens, ns)
        return {
            "name": record["name"],
            "model": record.get("model"),
            "tokens": len(tokens),
            "kv_bytes": record.get("kv_bytes", record.get("bytes")),
            "session": (record.get("session") or {}).get("id"),
            "tier": "+".join(t for t, on in (("ram", in_ram), ("ssd", on_ssd)) if on) or "missing",
            "saved": record.get("saved"),
            "preview": self._preview(ns, tokens),
        }

    def kv_info(self, *, session=None, checkpoint=None, last=False, layer=None) -> list[dict]:
        """Per-layer, per-array shapes, dtype, bytes, offset, hash prefix and value statistics."""
        entry = self._resolve_entry(session=session, checkpoint=checkpoint, last=last)
        return kv_inspect.kv_info(entry.checkpoint, layer)

    def kv_export(self, *, session=None, checkpoint=None, last=False, layer=None) -> dict:
        """The KV tensors as numpy copies ('layer{i}.keys' ...); bfloat16 becomes float32."""
        entry = self._resolve_entry(session=session, checkpoint=checkpoint, last=last)
        return kv_inspect.kv_export(entry.checkpoint, layer)

    def _preview(self, ns: str, tokens: tuple, limit: int = 80) -> str:
        key = (ns, len(tokens), hash(tokens))
        if key not in self._previews:
            m = self._model_for_namespace(ns)
            if m is None:
                return f"<{len(tokens)} tokens of an unloaded model>"
            # The start of the prefix is what a person recognizes; no chat-template markup.
            text = m.tokenizer.decode(list(tokens[:64]), skip_special_tokens=True)
            text = " ".join(text.split())
            if len(self._previews) > 4096:
                self._previews.clear()
            self._previews[key] = text if len(text) <= limit else text[: limit - 1] + "…"
        return self._previews[key]

    def cache_entries(self, poll: bool = True) -> list[dict]:
        """Every RAM and SSD entry as plain data (no MLX arrays are read).

        poll=True first applies finished writes (owner thread); poll=False is
        a view without side effects.
        """
        if poll:
            self.poll()
        rows, seen = [], set()
        names_by_key: dict = {}
        for r in self.names.list():
            names_by_key.setdefault((r["namespace"], tuple(r["tokens"])), []).append(r["name"])
        store = self.cache.store
        files = {(h.namespace, tuple(h.tokens)): h for h in store.entries()} if store is not None else {}
        for e in self.cache.entries():
            seen.add((e.ns, e.tokens))
            h = files.get((e.ns, e.tokens))
            rows.append(self._entry_row(
                e.ns, e.tokens, "ram+ssd" if h else "ram", e.write_state, names_by_key.get((e.ns, e.tokens), []),
                ram_bytes=e.nbytes, kv_bytes=e.checkpoint.kv_bytes, file_bytes=h.file_bytes if h else None,
                borrowers=e.borrowers, sessions=sorted(e.sessions), last_used=e.last_used_time, hits=e.hits,
            ))
        for key, h in files.items():
            if key not in seen:
                rows.append(self._entry_row(
                    h.namespace, key[1], "ssd", "committed", names_by_key.get(key, []),
                    ram_bytes=None, kv_bytes=h.raw_bytes, file_bytes=h.file_bytes,
                    borrowers=0, sessions=[], last_used=h.last_use, hits=0,
                ))
        return sorted(rows, key=lambda r: -(r["last_used"] or 0))

    def _entry_row(self, ns, tokens, tier, write_state, pinned, **fields) -> dict:
        """One `cache_entries` row. ram_bytes: resident footprint (None when not in RAM);
        kv_bytes: the KV state itself; file_bytes: its SSD file (None when not on SSD)."""
        m = self._model_for_namespace(ns)
        return {
            "model": m.name if m else None,
            "namespace": ns,
            "tokens": len(tokens),
            "preview": self._preview(ns, tokens),
            "tier": tier,
            "write_state": write_state,
            "pinned": pinned,
            **fields,
        }

    def cache_clear(self, ssd: bool = False) -> dict:
        """Drop RAM entries (and SSD files with ssd=True); named checkpoints stay on SSD.

        Clearing RAM alone first persists what is not on SSD yet, so it only
        frees memory; nothing reachable is lost.
        """
        store = self.cache.store
        if not ssd:
            self.flush(timeout=30)
        ram = len(self.cache.entries())
        files_before = store.stats()["files"] if store else 0
        kept = self.cache.clear(ssd=ssd)
        if ssd:
            for record in self.inflight.list():
                self.inflight.finish(record["request"])
        files_removed = files_before - (store.stats()["files"] if store else 0)
        self.events.emit("cache_cleared", ram_entries=ram - kept, ssd=ssd)
        return {"ram_entries": ram - kept, "kept_not_durable": kept, "ssd_files": files_removed}

    def cache_gc(self) -> dict:
        """Remove what nothing can use: quarantined files, stale temp files, dangling names and resume records."""
        report = {"quarantine_removed": 0, "temp_removed": 0, "dangling_names": [], "inflight_removed": 0}
        store = self.cache.store
        if store is not None:
            qdir = store.root / "quarantine"
            for p in qdir.iterdir() if qdir.exists() else ():
                p.unlink(missing_ok=True)
                report["quarantine_removed"] += 1
            for d in store.root.iterdir():
                for p in d.glob(".*.tmp") if d.is_dir() else ():
                    if time.time() - p.stat().st_mtime > 3600:
                        p.unlink(missing_ok=True)
                        report["temp_removed"] += 1
        for r in self.names.list():
            key = (r["namespace"], tuple(r["tokens"]))
            ns, tokens = key
            if self.cache.get_exact(tokens, ns) is None and not (store and store.contains(tokens, ns)):
                report["dangling_names"].append(r["name"])
        committed = {(h.namespace, h.key) for h in store.entries()} if store is not None else set()
        for record in self.inflight.list():
            if (record.get("namespace"), record.get("boundary_key")) not in committed:
                self.inflight.finish(record["request"])
                report["inflight_removed"] += 1
        return report

    def cache_verify(self) -> list[dict]:
        """Re-hash every SSD file; bad ones are quarantined and listed."""
        if self.cache.store is None:
            return []
        return [{"path": str(p), "reason": reason} for p, reason in self.cache.store.verify_all()]

    def close(self) -> dict | None:
        if self._closed:
            return None
        report = self.flush()
        self.cache.close()
        self._closed = True
        return report

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine is closed")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _vocab_size(m: LoadedModel) -> int | None:
    return m.config.get("vocab_size")
