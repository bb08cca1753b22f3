"""The Engine facade: models, the tiered prompt cache, sessions and generation.

A user reaches its parts as objects with methods of their own:

    eng.models        the resident models: get, use, info, unload, names(), default (models/registry.py)
    eng.sessions      chat sessions: new, get, reset, switch, close, list (chat/sessions.py)
    eng.checkpoints   named checkpoints: save, restore, remove, list (named/states.py)
    eng.kv            a state's KV tensors: info, export (named/states.py)
    eng.admin         the whole cache: entries, clear, gc, verify, wait_for_writes (admin/cache_admin.py)
    eng.objects       exact-key tensor objects: get, put, delete, clear (cache/objects/cache.py)
    eng.events        what happens, as plain records: subscribe, recent (events.py)

The facade's own methods coordinate several parts (load_model, encode_prompt, generate,
generate_tokens, generate_batch, score, score_groups, poll, flush, stats, close); the names the
design promises scripts (checkpoint_save, cache_clear, ...) are one-line delegations at the end.

All MLX work happens on the thread that calls the engine (the owner). The
SSD writer runs beside it on numpy views and reports back through `poll()`,
which every public call drains first.
"""

from __future__ import annotations

import os
import sqlite3
import time
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Callable, Sequence

from .host import blas
from .generate.batch.run import DEFAULT_BATCH_SIZE, BatchRun, batch_seeds, row_tokens
from .admin.cache_admin import CacheAdmin
from .cache.objects.cache import ObjectCache
from .cache.catalog.database import CatalogBusy
from .cache.remote import RemoteConfigError, resolve as resolve_remote
from .config import EngineConfig, default_cache_dir, hide_credentials  # noqa: F401 (engine.default_cache_dir)
from .cache.remote.link import attach as attach_remote, close as close_remote, flush as flush_remote
from .cache.tiered import TieredPromptCache
from .events import EventBus
from .generate.sampling import GenerationError, SamplingParams
from .kv.caches import always_cuttable
from .generate.resume import InflightRecords
from .media.prompt import new_counters as new_vision_counters, prompt_for as media_prompt
from .cache.retention import make_policy
from .host.memory import PressureGuard, ram_budget
from .metrics import AccessTrace, GenerationMetrics
from .models.registry import IdentityMemo, ModelRegistry
from .named.checkpoints import NamedCheckpoints
from .chat.prompts import encode_prompt
from .generate.scoring import ScoreResult, score
from .generate.passages.run import with_passages
from .generate.score_groups import score_groups
from .generate.generation import Generation, GenerationResult, Request, Services
from .chat.sessions import Sessions
from .chat.turn import ChatOptions, run_turn
from .generate.speculative.draft import load_with_draft, resolve_draft
from .generate.speculative.proposers import check_lookup
from .generate.grammars import OPTIONS as CONSTRAINT_OPTIONS, constraint_of, constraints_of
from .named.states import Checkpoints, KVInspection, StateFinder
from .host.safe_dirs import found as links_under, make_private_dir

_UNSET = object()  # a keyword not given: the environment's value, else the default
REMOTE_CLOSE_S = 5.0  # close() waits this long for remote publications, then says what was not published
REQUEST_OPTIONS = frozenset({f.name for f in fields(Request)} - {"model", "tokens", "params", "constraint"}
                            | set(CONSTRAINT_OPTIONS))  # besides sampling (a constraint: by its four keywords)


class Engine:
    def __init__(self, cache_dir: str | os.PathLike | None = _UNSET, ram_budget_bytes: int | None = _UNSET,
                 ssd_budget_bytes: int | None = _UNSET, *, config: EngineConfig | None = None, **options):
        """Options (config.py, `EngineConfig`): each keyword, else its environment variable, else its default;
        `config` instead of the environment. E.g. ram_budget_bytes (None: adapt to the machine's memory),
        ssd=False, prefill_chunk, prefetch_budget_bytes (0: no prefetch after a model load), retention ("lru" |
        "cost"), remote_url with remote_secret (a team secret of 16+ bytes, or several: the first seals)
        unless remote_insecure=True; remote_tls={"ca_file", "cert_file", "key_file"} for rediss://."""
        hide_credentials(options)  # first: a traceback's frames show them redacted from here on
        for name, value in (("cache_dir", cache_dir), ("ram_budget_bytes", ram_budget_bytes),
                            ("ssd_budget_bytes", ssd_budget_bytes)):
            if value is not _UNSET:
                options[name] = None if value is None else (str(value) if name == "cache_dir" else value)
        tls = options.pop("remote_tls", None)
        if tls is not None:
            unknown = set(tls) - {"ca_file", "cert_file", "key_file"}
            if unknown:
                raise RemoteConfigError(f"remote TLS settings: unknown {sorted(unknown)}; use ca_file, cert_file, "
                                        "key_file")
            options.update({f"remote_tls_{k}": v for k, v in tls.items()})
        config = (config.replace(**options) if config is not None else EngineConfig.from_env(**options)).check()
        self.config = config
        remote = resolve_remote(config.remote_url, secret=config.remote_secret, password=config.remote_password,
                                insecure=config.remote_insecure, tls=config.remote_tls,
                                signing_key=config.remote_signing_key, writers=config.remote_writers,
                                env={})  # refused before anything starts; the environment was read above
        self.cache_dir = Path(config.cache_dir or default_cache_dir()).expanduser()
        self.events = EventBus()
        self._ssd_disabled_reason: str | None = None  # why a requested SSD tier is off
        budget = ram_budget(config.ram_budget_bytes)  # None: the memory guard adapts
        kw = dict(ssd_budget_bytes=config.ssd_budget_bytes, write_behind=config.write_behind,
                  idle_demote_s=config.idle_demote_s, emit=self.events.emit, retention=make_policy(config.retention),
                  prefetch_budget_bytes=config.prefetch_budget_bytes,
                  ssd_filesystems=tuple(t.strip() for t in (config.ssd_filesystems or "").split(",") if t.strip()))
        try:
            make_private_dir(self.cache_dir)
            self.cache = TieredPromptCache(ram_budget_bytes=budget, ssd_dir=self.cache_dir / "checkpoints"
                                           if config.ssd else None, **kw)
        except (OSError, sqlite3.Error, CatalogBusy) as e:  # read-only, full, another user's, network, locked
            self._ssd_disabled_reason = f"cache directory {self.cache_dir} is not usable ({e}): running RAM-only"
            warnings.warn(f"mlxcache: {self._ssd_disabled_reason}", stacklevel=2)
            self.cache = TieredPromptCache(ram_budget_bytes=budget, ssd_dir=None, **kw)
        self.memory = PressureGuard(self.cache.reclaim, high=config.memory_high_water, low=config.memory_low_water,
                                    emit=self.events.emit, held=self.cache.held_bytes)
        self.cache.pressure = self.memory
        self.objects = ObjectCache(self.cache, self._check_open)  # exact-key tensor objects on the same tiers
        self.vision_counters = new_vision_counters()  # images, encoder runs (media/prompt.py)
        usable = self._ssd_disabled_reason is None
        self.models = ModelRegistry(IdentityMemo(self.cache_dir / "identities.json" if usable else None),
                                    emit=self.events.emit)
        self.metrics = GenerationMetrics()
        self.last_result: GenerationResult | None = None
        self.last_key: tuple | None = None  # (namespace, tokens) of the last generation's checkpoint
        self.sessions = Sessions(cache=self.cache, models=self.models, events=self.events, poll=self.poll,
                                 loops=self.cache_dir / "loops" if usable and self.cache.has_ssd else None)
        names = NamedCheckpoints(self.cache_dir / "names" if usable else None)  # the records of named checkpoints
        find = StateFinder(self.cache, names, self.sessions, last_key=lambda: self.last_key)
        self.checkpoints = Checkpoints(cache=self.cache, names=names, sessions=self.sessions, models=self.models,
                                       events=self.events, poll=self.poll, find=find)
        self.kv = KVInspection(find)
        inflight = InflightRecords(self.cache.catalog, legacy_dir=self.cache_dir / "inflight")
        self.admin = CacheAdmin(cache=self.cache, names=names, models=self.models, objects=self.objects,
                                inflight=inflight, events=self.events, poll=self.poll, flush=self.flush)
        self._services = Services(self.cache, inflight, self.memory, self.metrics, self.events,
                                  AccessTrace(config.trace_path), config.prefill_chunk, on_published=self._published,
                                  explain=self.admin.explainer.explain)
        if remote is not None:  # a shared tier below SSD (Redis / Valkey)
            attach_remote(self.cache, remote, publish=config.remote_publish, prefill_rate=self.metrics.prefill_rate.get,
                          exact=self._may_be_exact, model_of=self.models.by_namespace, emit=self.events.emit)
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once close() ran: a closed engine refuses to generate or to touch objects (RuntimeError)."""
        return self._closed

    @property
    def prefill_chunk(self) -> int:
        """Tokens per prefill forward (a tuning knob: see docs/benchmarks.md); settable."""
        return self._services.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:
        self._services.prefill_chunk = int(tokens)

    # --- models ---

    def load_model(self, path_or_id, name: str = "default", *, kv_bits: int | None = None, kv_group_size: int = 64,
                   adapter_path=None, image_attention: str | None = None, kv_start: int | None = None,
                   draft: str | None = None, chat_template=None) -> dict:
        """Load a model; kv_bits (4 or 8) quantizes its KV cache (RAM and SSD hold the quantized bytes) once a
        sequence passes kv_start tokens (default 5000, as mlx-lm's --quantized-kv-start; 0: from the first
        token). adapter_path: an mlx-lm LoRA adapter directory (a cache namespace of its own). A vision-language
        model loads through mlx-vlm (the [vision] extra); image_attention: how its image tokens attend
        ("bidirectional" or "causal" for Gemma 3). draft: a loaded model's name, the default draft of this
        model's generations. chat_template: a template file or text used instead of the model's own (as
        mlx-lm's --chat-template). Then its most recently used SSD checkpoints start loading into RAM in the
        background (up to the prefetch budget); "prefetch" in the result says how many."""
        loaded = load_with_draft(self.models, draft, path_or_id, name, kv_bits=kv_bits, kv_group_size=kv_group_size,
                                 adapter_path=adapter_path, image_attention=image_attention, kv_start=kv_start,
                                 chat_template=chat_template)
        self.cache.register_namespace(loaded.namespace, loaded.identity)
        self.events.emit("model_loaded", name=name, path=str(loaded.path), namespace=loaded.namespace)
        if loaded.cache_notice:
            self.events.emit("notice", model=name, message=loaded.cache_notice)
        prefetch = self.cache.prefetch(loaded.namespace) if loaded.cache_notice is None else None
        return {**self.models.info(name), "prefetch": prefetch}

    # --- prompts ---

    def encode_prompt(self, prompt: str, *, model: str | None = None, system: str | None = None,
                      raw: bool = False, session: str | None = None, truncate: str | None = None) -> list[int]:
        """The prompt as token ids: the chat template (with the session's history), or raw."""
        m = self.models.get(model)
        s = self.sessions.get_or_create(session, system=system, model=m.name) if session is not None else None
        return encode_prompt(m.tokenizer, prompt, system=system, raw=raw, session=s, config=m.config, truncate=truncate)

    # --- generation ---

    def generate(self, prompt: str, *, session: str | None = None, model: str | None = None, system: str | None = None,
                 raw: bool = False, use_cache: bool = True, on_text: Callable[[str], None] | None = None,
                 on_progress: Callable[[str, int, int], None] | None = None, checkpoint_every: int | None = None,
                 images: Sequence | None = None, videos: Sequence | None = None, fps: float | None = None,
                 max_frames: int | None = None, audios: Sequence | None = None, draft: str | bool | None = None,
                 num_draft_tokens: int | None = None, lookup: bool | None = None, response_format=None, regex=None,
                 choices=None, grammar=None, passages: Sequence[str] | None = None, recompute: float | None = None,
                 truncate: str | None = None, template_args: dict | None = None, think: bool | None = None,
                 tools: Sequence | None = None, tool_choice: str | None = None, max_steps: int | None = None,
                 confirm: Callable | None = None, on_reasoning: Callable | None = None, on_step: Callable | None = None,
                 params: SamplingParams | None = None, **sampling) -> GenerationResult:
        """sampling: SamplingParams's options (max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop=(),
        logprobs=None), or params=. images, videos (at fps, up to max_frames), audios: for a VLM (media/). draft: a
        loaded model proposing num_draft_tokens (4) per verify (default: the model's own; False: none); lookup: drafts
        from the context (None: where they pay). response_format (Pydantic, JSON Schema), regex, choices, grammar
        (Lark, GBNF): the answer follows it, `.parsed` holds it (docs/constrained.md). passages: texts placed from
        their cached KV, `recompute` of them recomputed (approximate: generate/passages/). truncate: "left", "middle"
        cut a prompt past the window (generate/window.py). A chat turn (chat/turn.py): template_args, think (the
        template's switch); .reasoning apart from .text (on_reasoning); tools (tool_choice "auto", "required",
        "none"; max_steps; confirm(call) -> bool), each step in .steps (on_step)."""
        self._check_open()
        self.poll(prepare=False)  # no buffers allocated for prefetches on the way to the first token
        params = SamplingParams.from_call(params, sampling)
        m = self.models.get(model)
        params.validate(m.config.get("vocab_size"))
        constraint = constraint_of(m, response_format, regex, choices, grammar)  # refused before any work
        chat = ChatOptions(template_args, think, tools, tool_choice, max_steps, confirm, on_reasoning, on_step).check(
            constraint, templated=not (raw or m.vision or passages is not None))
        run = dict(session=session, use_cache=use_cache, on_text=on_text, on_progress=on_progress, draft=draft,
                   checkpoint_every=checkpoint_every, num_draft_tokens=num_draft_tokens, lookup=lookup, constraint=constraint,
                   truncate=truncate)
        if passages is not None:  # placed from their cached KV: approximate, opt-in (generate/passages/run.py)
            return with_passages(self, m, params, prompt, passages, recompute, system=system, raw=raw, run=run,
                                 media=images or videos or audios)
        if not (raw or m.vision or images or videos or audios):  # a chat turn: reasoning apart, tools (chat/turn.py)
            return run_turn(self.sessions, self._generate, m, prompt, chat, params, run, system=system)
        media = media_prompt(self, m, prompt, images, system=system, raw=raw, session=session, use_cache=use_cache,
                             videos=videos, fps=fps, max_frames=max_frames, audios=audios) if m.vision else None
        if media is None and (images or videos or audios):
            raise GenerationError(f"model {m.name!r} is not a vision-language model: it takes no images, videos or audio")
        tokens = media.keys if media is not None else self.encode_prompt(
            prompt, model=m.name, system=system, raw=raw, session=session, truncate=truncate)
        result = self._generate(m, tokens, params, dict(run, media=media))
        if session is not None:
            self.sessions.get(session).record_turn(prompt, result.text, tokens, result.tokens,
                                                   images=media.images if media else ())
        return result

    def generate_batch(self, prompts: Sequence, *, seed: int | Sequence[int] = 0, model: str | None = None,
                       system: str | None = None, raw: bool = False, use_cache: bool = True,
                       batch_size: int = DEFAULT_BATCH_SIZE, lookup: bool | None = None,
                       on_progress: Callable[[str, int, int], None] | None = None,
                       on_row: Callable[[int, GenerationResult], None] | None = None, response_format=None,
                       regex=None, choices=None, grammar=None, truncate=None, **sampling) -> list[GenerationResult]:
        """One GenerationResult per prompt (a string or token ids), in order: shared prefixes prefilled once, rows
        decoded together (generate/batch/run.py). sampling: SamplingParams's options, for every row; row i samples
        with seed + i (or seed[i] from a list). response_format, regex, choices, grammar as `generate` takes them,
        for every row, or a list with one per row (None: that row free); truncate as `generate`'s, for each row.
        on_progress(phase, done, total): "restore"/"prefill" in tokens, "decode" in tokens generated;
        on_row(index, result) as each row finishes."""
        self._check_open()
        self.poll(prepare=False)
        m = self.models.get(model)
        vocab = m.config.get("vocab_size")
        encode = lambda p: self.encode_prompt(p, model=m.name, system=system, raw=raw, truncate=truncate)  # noqa: E731
        rows = row_tokens(prompts, encode, vocab)
        params = [SamplingParams.of(**sampling, seed=s).validate(vocab) for s in batch_seeds(seed, len(rows))]
        constraints = constraints_of(m, len(rows), response_format, regex, choices, grammar)
        if not rows:
            return []
        results = BatchRun(self._services, m, rows, params, use_cache=use_cache, batch_size=batch_size,
                           lookup=check_lookup(lookup), constraints=constraints, truncate=truncate,
                           on_progress=on_progress, on_row=on_row).run()
        self.last_result = results[-1]
        return results

    def score(self, context, continuations: Sequence, *, model: str | None = None, raw: bool = True,
              system: str | None = None, use_cache: bool = True, on_progress=None, truncate=None) -> list[ScoreResult]:
        """The log-likelihood of each continuation given the context, in order (lm-eval's loglikelihood: `.logprob`,
        `.token_logprobs`, `.greedy`). Strings are tokenized as lm-eval does; token ids pass through. raw=False: the
        context is a chat turn (the template with its generation prompt), each continuation the assistant's reply.
        The context comes from the cache (or is prefilled once: on_progress as generate's) and every continuation goes
        in one batch over it (generate/scoring.py); one past the window: refused, or cut by truncate ("left", "middle")."""
        self._check_open()
        self.poll(prepare=False)
        return score(self._services, self.models.get(model), context, continuations, raw=raw, system=system,
                     use_cache=use_cache, on_progress=on_progress, truncate=truncate)

    def score_groups(self, pairs: Sequence, *, model: str | None = None, use_cache: bool = True,
                     on_progress: Callable[[str, int, int], None] | None = None) -> list[ScoreResult]:
        """`score` of many (context, continuation) pairs (lm-eval's loglikelihood requests), one result
        each in order: a prefix the contexts share (a few-shot block) prefilled once, each context once
        for its continuations, the continuations batched (generate/score_groups.py).
        on_progress("score", done, total)."""
        self._check_open()
        self.poll(prepare=False)
        return score_groups(self._services, self.models.get(model), pairs, use_cache=use_cache, on_progress=on_progress)

    def generate_tokens(self, tokens: Sequence[int], *, model: str | None = None,
                        params: SamplingParams | None = None, **options) -> GenerationResult:
        """Generate from prompt token ids: resume or cache lookup, prefill, decode, publish (generate/generation.py).

        options: the sampling options of `generate` (or params=SamplingParams(...)), and session, use_cache, on_text,
        on_progress, checkpoint_every, draft, num_draft_tokens, lookup, response_format, regex, choices, grammar."""
        self._check_open()
        m = self.models.get(model)
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise GenerationError("empty prompt: no tokens to generate from")
        params = SamplingParams.from_call(params, options, REQUEST_OPTIONS).validate(m.config.get("vocab_size"))
        options["constraint"] = constraint_of(m, *(options.pop(k, None) for k in CONSTRAINT_OPTIONS))
        return self._generate(m, tokens, params, options)

    def _generate(self, m, tokens: list, params: SamplingParams, options: dict) -> GenerationResult:
        """One generation of `m` from prompt tokens; options: a Request's fields (the constraint compiled)."""
        options["draft"], options["num_draft_tokens"] = resolve_draft(self.models, m, options.get("draft"),
                                                                      options.pop("num_draft_tokens", None))
        req = Request(m, tokens, params, **options).check(self.cache.has_ssd)
        req.use_cache = req.use_cache and m.cache_notice is None  # an unknown cache class: uncached, never wrong
        self.last_result = Generation(self._services, req).run()
        self.cache.loading.prepare_reads()  # prefetching goes on after the generation (it yielded meanwhile)
        stats = self.last_result.stats
        self.events.emit("generation", **{k: v for k, v in stats.items() if not isinstance(v, (list, dict))})
        return self.last_result

    # --- cache control ---

    def poll(self, prepare: bool = True) -> None:
        """Apply finished background work; give memory back if the machine runs short (owner thread).
        prepare=False: do not allocate buffers for the next background reads now."""
        self.cache.poll(prepare)
        self.memory.check("idle")

    def flush(self, timeout: float | None = None) -> dict:
        """Wait until every queued write is durable (and published remotely); returns a report.
        `timeout` bounds both waits together."""
        t0 = time.monotonic()
        report = self.cache.flush(timeout=timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        report["remote_failed"] = flush_remote(self.cache.remote, left)
        return report

    def stats(self) -> dict:
        """Plain numbers; never touches MLX arrays."""
        return {"blas": blas.active_blas(), "models": self.models.names(), "default_model": self.models.default,
                "sessions": len(self.sessions.list()), "cache_dir": str(self.cache_dir),
                "ssd_disabled_reason": self._ssd_disabled_reason, "cache_links": links_under(self.cache_dir),
                **self.metrics.as_stats(), **self.memory.stats(), **self.cache.stats(), **self.objects.stats(),
                **self.vision_counters}

    def close(self) -> dict | None:
        if self._closed:
            return None
        self.cache.loading.close_reader()  # background reads are only a cache: stop them first
        report = self.cache.flush()
        report["remote_failed"] = close_remote(self.cache.remote, REMOTE_CLOSE_S)  # a bounded wait, then named
        if report["remote_failed"]:
            warnings.warn(f"mlxcache: remote tier: {len(report['remote_failed'])} publication(s) failed or not "
                          f"finished at close: {'; '.join(report['remote_failed'][:3])}", stacklevel=2)
        self.cache.close()
        self._closed = True
        return report

    # --- the names the design promises scripts, notebooks and outside checks: one line each, the parts
    # hold the logic (tests/engine/test_facade.py lists them) ---

    def checkpoint_save(self, name: str, *, session: str | None = None, model: str | None = None) -> dict:
        """eng.checkpoints.save: pin the session's latest (or the last generation's) state under a name."""
        return self.checkpoints.save(name, session=session, model=model)

    def checkpoint_restore(self, name: str) -> dict:
        """eng.checkpoints.restore: a named state resident again (from SSD in the background), its chat too."""
        return self.checkpoints.restore(name)

    def checkpoint_list(self) -> list[dict]:
        """eng.checkpoints.list: every name, its model, tokens, tier and preview."""
        return self.checkpoints.list()

    def cache_clear(self, ssd: bool = False) -> dict:
        """eng.admin.clear: drop RAM entries (and SSD files with ssd=True); named checkpoints stay."""
        return self.admin.clear(ssd=ssd)

    def cache_gc(self, dry_run: bool = False, quarantine: bool = False) -> dict:
        """eng.admin.gc: remove what nothing can use (stale temp files, orphan resume records)."""
        return self.admin.gc(dry_run=dry_run, quarantine=quarantine)

    def cache_verify(self) -> list[dict]:
        """eng.admin.verify: re-hash every SSD file; bad ones are quarantined and listed."""
        return self.admin.verify()

    def _published(self, key: tuple) -> None:
        self.last_key = key

    def _may_be_exact(self, ns: str) -> bool:
        """Whether a namespace's states may be exact only at their length (remote exact records; kv_start)."""
        m = self.models.by_namespace(ns)
        return m is None or bool(m.kv_start) or not always_cuttable(m.new_caches())

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Engine is closed")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

