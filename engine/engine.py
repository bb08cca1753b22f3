"""The Engine facade: models, the tiered prompt cache, sessions and generation.

All MLX work happens on the thread that calls the engine (the owner). The
SSD writer runs beside it on numpy views and reports back through `poll()`,
which every public call drains first.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from . import blas
from .checkpoint import Checkpoint
from .events import EventBus
from .generation import DecodeResult, GenerationError, SamplingParams, TextStream, decode, prefill
from .models import IdentityMemo, LoadedModel, ModelRegistry
from .sessions import Sessions
from .tiered import TieredPromptCache

DEFAULT_PREFILL_CHUNK = 512


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
    ) -> GenerationResult:
        self._check_open()
        self.poll()
        params = SamplingParams(max_tokens, float(temperature), float(top_p), int(top_k), seed, tuple(stop))
        m = self.models.get(model)
        params.validate(_vocab_size(m))
        tokens = self.encode_prompt(prompt, model=m.name, system=system, raw=raw, session=session)
        result = self.generate_tokens(
            tokens, params, model=m.name, session=session, use_cache=use_cache, on_text=on_text, on_progress=on_progress
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
    ) -> GenerationResult:
        """Generate from prompt token ids: cache lookup, prefill, decode, publish."""
        self._check_open()
        m = self.models.get(model)
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise GenerationError("empty prompt: no tokens to generate from")
        params.validate(_vocab_size(m))
        ns = m.namespace
        if hasattr(mx, "reset_peak_memory"):
            mx.reset_peak_memory()
        t0 = time.perf_counter()
        lease = self.cache.take(tokens, ns, session=session, progress=on_progress) if use_cache else None
        caches = lease.caches if lease else make_prompt_cache(m.model)
        cached = lease.length if lease else 0
        source = lease.source if lease else None
        t_lookup = time.perf_counter() - t0
        try:
            with self.cache.generating():
                t1 = time.perf_counter()
                suffix = tokens[cached:-1]
                if suffix:
                    prefill(
                        m.model,
                        caches,
                        suffix,
                        chunk=self.prefill_chunk,
                        progress=(lambda done, total: on_progress("prefill", done, total)) if on_progress else None,
                    )
                prefill_s = time.perf_counter() - t1
                out = self._decode(m, caches, tokens, params, ns, use_cache, on_text, t0)
        finally:
            if lease:
                lease.release()
        decoded, stream, times = out
        if use_cache:
            final = tokens + decoded.tokens[: decoded.forwarded]
            self.cache.put(Checkpoint.capture(final, caches), ns, session=session)
        del caches
        stats = self._stats_for(tokens, cached, source, len(suffix), prefill_s, t_lookup, decoded, times)
        self.last_result = GenerationResult(stream.text, decoded.tokens, stats, list(tokens))
        self.events.emit("generation", **{k: v for k, v in stats.items() if not isinstance(v, (list, dict))})
        return self.last_result

    def _decode(self, m: LoadedModel, caches, tokens, params, ns, use_cache, on_text, t0):
        stream = TextStream(m.tokenizer, params.stop)
        times: list[float] = []
        snapshot_needed = use_cache and self.cache.get_exact(tokens, ns) is None

        def on_token(token: int, step: int) -> bool:
            times.append(time.perf_counter())
            piece = stream.add(token)
            if piece and on_text:
                on_text(piece)
            if step == 0 and snapshot_needed:
                # The prompt boundary, so the next turn reuses the prompt even
                # when the generated text re-tokenizes differently. A copy:
                # this generation keeps appending to its own buffers.
                self.cache.put(Checkpoint.capture(tokens, caches, copy=True, length=len(tokens)), ns)
            return stream.stopped

        decoded: DecodeResult = decode(m.model, caches, tokens[-1:], params, eos_ids=m.eos_token_ids, on_token=on_token)
        if len(times) < len(decoded.tokens):  # the eos token is not passed to on_token
            times.append(time.perf_counter())
        tail = stream.finish()
        if tail and on_text:
            on_text(tail)
        return decoded, stream, (t0, times)

    def _stats_for(self, tokens, cached, source, prefilled, prefill_s, lookup_s, decoded, times) -> dict:
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
            "prefilled_tokens": prefilled + 1,
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
        if prefilled and prefill_s > 0 and cached:
            c["prefill_s_saved"] += cached * prefill_s / prefilled
        return stats

    # --- cache control ---

    def poll(self) -> None:
        """Apply finished background work (owner thread)."""
        self.cache.poll()

    def flush(self, timeout: float | None = None) -> dict:
        """Wait until every queued write is durable; returns a report."""
        return self.cache.flush(timeout=timeout)

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
