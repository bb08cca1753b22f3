"""Counters and the one stats schema.

Every number the engine reports is named here once (`SCHEMA`), with what it
means; `Engine.stats()` returns exactly these keys, and `%cache stats`, the
dashboard and the benchmarks read them by these names. Bytes are named apart:

- `*ram*_bytes` / `ram_used_bytes`: what RAM entries hold (whole buffers; one several entries share, once);
- `*kv_bytes`: the KV state itself, cut to its tokens;
- `ssd_bytes`: unique bytes on disk (each manifest or file once, each shared block once);
  `bytes_written`: what this process wrote; `ssd_bytes_deduplicated`: what it found stored already.

Reading stats never touches an MLX array.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def fmt_bytes(n) -> str:
    """Binary units, as the budgets are given (e.g. MLXCACHE_RAM_BUDGET=256MiB)."""
    if n is None:
        return "–"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"  # pragma: no cover


SCHEMA = {
    # engine
    "blas": "the BLAS under MLX's CPU matmuls",
    "models": "names of resident models",
    "default_model": "the model used when none is named",
    "sessions": "open chat sessions",
    "cache_dir": "the cache directory",
    "ssd_disabled_reason": "why the SSD tier is off though it was asked for (None: it is on, or was not asked for)",
    "cache_links": "directories inside the cache directory found to be symbolic links (or not directories), each "
                   "with what it is: not used, nothing behind them touched (the cache runs without them)",
    "engine_generations": "generations run",
    "engine_prompt_tokens": "prompt tokens over all generations",
    "engine_cached_tokens": "prompt tokens served from the cache (RAM or SSD)",
    "engine_ram_tokens": "prompt tokens served from RAM",
    "engine_ssd_tokens": "prompt tokens served from SSD",
    "engine_remote_tokens": "prompt tokens served from the remote tier",
    "engine_prefilled_tokens": "prompt tokens forwarded through the model",
    "engine_draft_tokens_proposed": "tokens draft models proposed in speculative decoding (judged by the model)",
    "engine_draft_tokens_accepted": "proposed draft tokens the model accepted",
    "engine_prefill_s": "seconds spent prefilling",
    "engine_prefill_s_saved": "prefill seconds the cache saved, at each model's measured prefill rate",
    "engine_decode_tokens": "tokens generated",
    # memory the kernel really has (host/memory.py)
    "pressure_checks": "memory readings taken (at lookups, after prefill, during decode, between cells)",
    "pressure_reclaims": "times the working set passed the high-water mark and entries were let go",
    "pressure_freed_bytes": "RAM bytes let go under memory pressure",
    "pressure_events": "times the memory guard's state changed (a reclaim, memory short with nothing to let go, "
                       "calm again): one 'pressure' event each, none while it stays",
    "memory_working_bytes": "this process's working set at the last reading (RSS, or MLX memory if larger)",
    "memory_available_bytes": "memory the machine could still give at the last reading",
    "memory_high_water_bytes": "past this working set, entries are let go (a share of what the kernel may use)",
    "memory_low_water_bytes": "reclaim goes down to this working set",
    "memory_room_bytes": "what cache entries may hold under the high-water mark beside the rest of the process (read "
                         "between generations); an entry larger than this is kept on SSD only",
    "memory_note": "while memory is short and the cache has nothing more to let go: that, in words (else None)",
    # RAM tier
    "ram_used_bytes": "RAM held by cache entries (their buffers as allocated; a shared one once)",
    "ram_kv_bytes": "KV bytes of the RAM entries, cut to their tokens (a shared prefix once)",
    "ram_budget_bytes": "RAM budget for cache entries (None: no cap)",
    "ram_entries": "checkpoints resident in RAM",
    "hits": "lookups served from RAM or SSD",
    "misses": "lookups that found nothing usable",
    "evictions": "RAM entries evicted by the budget",
    "supersessions": "RAM entries replaced by a longer checkpoint that serves them",
    "oversized": "checkpoints larger than the whole budget (kept on SSD only)",
    "handovers": "entries that gave their buffers to the generation extending them",
    "handovers_lent": "entries that lent their buffers to a generation branching off them, and took them back",
    # durability (RAM -> SSD)
    "write_behind": "whether finished checkpoints are queued for SSD at once",
    "ssd_enabled": "whether the SSD tier is on",
    "pending_writes": "SSD writes queued or in progress",
    "pending_write_bytes": "bytes of those writes",
    "write_in_progress_bytes": "bytes written so far of the write in progress",
    "write_in_progress_total": "total bytes of the write in progress",
    "dirty_entries": "RAM entries not yet queued for SSD",
    "dirty_bytes": "RAM bytes of those entries",
    "failed_entries": "RAM entries whose last SSD write failed (kept, retried)",
    "failed_bytes": "RAM bytes of those entries",
    "ssd_hits": "lookups served by restoring an SSD file",
    "ssd_tokens": "tokens restored from SSD",
    "ssd_restore_failures": "SSD restores that failed (a miss; the file is quarantined)",
    "demotions": "RAM entries dropped because their SSD copy is durable",
    "writes_queued": "SSD writes queued",
    "writes_committed": "SSD writes committed (fsynced and renamed)",
    "writes_failed": "SSD writes that failed",
    "bytes_written": "bytes this process wrote to SSD (new blocks and manifests)",
    "inflight_queued": "in-flight generation checkpoints queued",
    "inflight_replaced": "in-flight checkpoints replaced by a newer interval before they were written",
    "writes_cancelled": "SSD writes dropped (queued) or given up (being written) because a longer checkpoint superseded their entry, or a rerun took its buffers",
    "writes_skipped_stored": "writes not made because a committed file already holds the same tokens (a rerun of a cell)",
    "dropped_unwritable": "RAM entries let go over budget while their SSD writes kept failing",
    "write_error": "the latest SSD write error, until a write succeeds again",
    # background reads: prefetch after a model loads, %checkpoint restore, %session switch (cache/loading.py)
    "prefetch_budget_bytes": "the prefetch budget set (None: a quarter of the RAM budget, or of the memory the kernel may use; 0: off)",
    "prefetches_started": "background reads of SSD checkpoints queued (prefetches, named checkpoints, sessions)",
    "prefetches_completed": "background reads that finished and were verified",
    "prefetches_failed": "background reads that failed (a miss; a bad file or block is quarantined)",
    "prefetches_dropped": "prefetches not adopted: no room left in RAM, memory pressure, resident already, or cancelled",
    "prefetch_bytes": "KV bytes read by finished background reads",
    "prefetches_in_progress": "background reads queued or being read now",
    "prefetch_in_progress_bytes": "KV bytes of those reads",
    "prefetch_waits": "lookups that waited for a background read of the file they needed (instead of a second read)",
    "prefetch_wait_seconds": "seconds those lookups waited",
    "restore_shared_bytes": "KV bytes of checkpoints read back from SSD held in the buffers of an entry read from the same blocks (a document under several questions: once in RAM after a restart too)",
    # SSD tier (present when it is on)
    "ssd_files": "checkpoint files on SSD",
    "ssd_bytes": "unique bytes on SSD: manifests and files once each, each shared block once",
    "ssd_blocks": "KV blocks on SSD (format 2; shared by the manifests that name them)",
    "ssd_block_bytes": "bytes of those blocks",
    "ssd_bytes_written": "bytes the writer wrote (new blocks and manifests)",
    "ssd_bytes_deduplicated": "bytes the writer did not write because identical blocks (or manifests) were stored",
    "ssd_blocks_freed": "blocks removed because no manifest referenced them any more",
    "ssd_kv_bytes": "KV bytes in those files",
    "ssd_budget_bytes": "SSD budget (None: no cap)",
    "ssd_quarantined": "files found bad and moved to quarantine",
    "ssd_restores": "files restored",
    "ssd_restore_bytes": "KV bytes restored",
    "ssd_restore_seconds": "seconds spent restoring (read and verify)",
    "ssd_evicted": "files removed by supersession, the SSD budget or clear",
    "ssd_newer_format_files": "files of a newer format version, left alone",
    "ssd_processes": "processes using this cache directory now (this one included)",
    "ssd_processes_pending_writes": "SSD writes those processes have pending",
    "ssd_late_reason": "why SSD reads and writes wait right now (another process holds the catalogue's lock), or None",
    "ssd_unleased_reads": "reads done without a catalogue lease because the catalogue was locked (a deletion meanwhile is a miss)",
    "ssd_dropped_missing_blocks": "checkpoints dropped from the index because a block they name is gone (removed by gc)",
    # exact tensor objects (Engine.objects, @memo): they share the RAM and SSD numbers above
    "object_puts": "objects stored (put)",
    "object_put_bytes": "bytes of the values stored",
    "object_ram_hits": "object lookups served from RAM",
    "object_ssd_hits": "object lookups served by reading (and verifying) an SSD file",
    "object_remote_hits": "object lookups served from the remote tier (then written through to SSD)",
    "object_misses": "object lookups that found nothing usable",
    "object_restore_failures": "object reads that failed (a miss; a bad file is quarantined)",
    "object_restore_bytes": "bytes of the objects read from SSD or the remote tier",
    "object_restore_seconds": "seconds spent reading and verifying objects from SSD",
    # images and videos in prompts of vision-language models (media/prompt.py)
    "vision_images": "images in the prompts of generations",
    "vision_encoder_runs": "times the vision encoder ran (an image or video neither in a cached prefix nor cached as an object)",
    "vision_encoder_s": "seconds the vision encoder ran",
    "vision_encoder_reused": "images and videos whose encoder output came from the object cache (RAM or SSD)",
    "vision_images_in_prefix": "images whose KV came with a cached prefix (no encoder, no prefill of their tokens)",
    "vision_videos": "videos in the prompts of generations",
    "vision_videos_in_prefix": "videos whose KV came with a cached prefix (no encoder, no prefill of their tokens)",
    "vision_recordings": "audio recordings in the prompts of generations",
    "vision_recordings_in_prefix": "recordings whose KV came with a cached prefix (no encoder, no prefill of their tokens)",
    "object_ram_entries": "objects resident in RAM (counted in ram_entries too)",
    "object_ram_bytes": "RAM bytes those objects hold (counted in ram_used_bytes too)",
    "object_ssd_files": "objects on SSD (counted in ssd_files too)",
    "object_ssd_bytes": "bytes of their SSD files",
    # the remote tier (None or 0 while it is off)
    "remote_url": "the remote tier's URL, credentials removed (None: off)",
    "remote_auth": "keyed (key id ...) with a team secret, or UNAUTHENTICATED (remote_insecure)",
    "remote_publish": "which checkpoints are published remotely: all, named or none",
    "remote_state": "ok, or open until <time> (the circuit breaker stopped calling a failing remote)",
    "remote_last_error": "the remote's last error, credentials removed",
    "remote_hits": "lookups served from the remote tier",
    "remote_tokens": "tokens fetched from the remote tier",
    "remote_misses": "remote reads that failed or did not verify (a miss)",
    "remote_skipped": "remote prefixes not fetched because prefilling was estimated faster",
    "remote_fetch_seconds": "seconds spent fetching and rebuilding remote prefixes",
    "remote_published": "checkpoints queued for publication",
    "remote_kv_checked": "remote hits whose first layer was recomputed from their tokens and matched",
    "remote_kv_unchecked": "remote hits this model cannot check so (a sliding or quantized first layer, a VLM)",
    "remote_kv_mismatch": "remote prefixes whose first layer was not that of their tokens (forged: a miss)",
    "remote_verified": "remote states recomputed here in idle time and found equal (then kept on SSD)",
    "remote_verify_tokens": "tokens of remote states recomputed in idle time",
    "remote_verify_seconds": "seconds of idle-time recomputation of remote states",
    "remote_forged": "remote states found not to be what this model computes (dropped; their writer distrusted)",
    "remote_verify_dropped": "remote states dropped before their verification finished (never kept)",
    "remote_distrusted": "remote hits refused: their writer was caught serving wrong KV on this machine",
    "remote_sampled": "remote hits whose sampled positions were recomputed through every layer at fetch time",
    "remote_sample_unchecked": "remote hits the sampled check does not apply to (not plain KV in every layer)",
    "remote_sample_seconds": "seconds spent on the fetch-time sampled check",
    "remote_not_republished": "checkpoints not published because they came from (or extend) a remote entry",
    "remote_revoked_dropped": "local entries from the remote dropped at start: their writer or secret was revoked",
    "remote_unknown_writer": "remote records refused: not signed by a writer on the allow-list (a miss)",
    "remote_signature_rejected": "remote records whose writer's signature did not verify (a miss)",
    "remote_tombstoned": "remote records written back after a remove() (older than its signed tombstone: a miss)",
    "remote_layout_missing": "remote prefixes whose layout (stored once per publication) was gone or not theirs (a miss)",
    "remote_publish_pending": "publications waiting or running",
    "remote_publish_failed": "publications that failed",
    "remote_blocks_uploaded": "blocks uploaded (the remote lacked them)",
    "remote_blocks_skipped": "blocks not uploaded because the remote had them",
    "remote_bytes_read": "bytes read from the remote",
    "remote_bytes_written": "bytes written to the remote",
    "remote_mac_rejected": "prefix records rejected by their MAC (written without the team secret)",
    "remote_malformed": "remote records, layouts or manifests that verified but could not be used (a miss)",
    "remote_stale": "remote records older than their maximum age, or issued in the future (a miss)",
    "remote_wrong_size": "remote values not read because their size was not what their record says (a miss)",
    "remote_bad_blocks": "remote blocks that did not hash to their name (a miss; removed for re-upload)",
    "remote_deadline_missed": "remote calls abandoned at their deadline (slow or dripping server)",
    "remote_errors": "calls to the remote that failed",
    "remote_get_bandwidth_bytes_per_s": "measured remote read bandwidth (None until measured)",
    "remote_latency_s": "estimated remote round trip, from probes (None until measured)",
}

_GENERATION_COUNTERS = (
    "generations", "prompt_tokens", "cached_tokens", "ram_tokens", "ssd_tokens", "remote_tokens",
    "prefilled_tokens", "prefill_s", "prefill_s_saved", "decode_tokens", "draft_tokens_proposed",
    "draft_tokens_accepted",
)


class GenerationMetrics:
    """Engine-wide generation counters and each model's measured prefill rate."""

    def __init__(self):
        self.counters = {k: 0.0 if k.endswith("_s") or k == "prefill_s_saved" else 0 for k in _GENERATION_COUNTERS}
        self.prefill_rate: dict[str, float] = {}  # namespace -> prompt tokens/s, smoothed

    def record(self, ns: str, stats: dict) -> None:
        c = self.counters
        c["generations"] += 1
        for k in ("prompt_tokens", "cached_tokens", "ram_tokens", "ssd_tokens", "remote_tokens", "prefilled_tokens",
                  "decode_tokens"):
            c[k] += stats[k]
        for k in ("draft_tokens_proposed", "draft_tokens_accepted"):  # speculative decoding only
            c[k] += stats.get(k) or 0
        c["prefill_s"] += stats["prefill_s"]
        self._measured(ns, stats["prefilled_tokens"], stats["prefill_s"])
        if stats["cached_tokens"] and self.prefill_rate.get(ns):
            c["prefill_s_saved"] += stats["cached_tokens"] / self.prefill_rate[ns]

    def record_prefill(self, ns: str, prefilled: int, seconds: float) -> None:
        """A prefill that belongs to no one generation (a prefix the rows of a batch share)."""
        self.counters["prefilled_tokens"] += prefilled
        self.counters["prefill_s"] += seconds
        self._measured(ns, prefilled, seconds)

    def _measured(self, ns: str, prefilled: int, seconds: float) -> None:
        if prefilled >= 16 and seconds > 0:  # a real prefill: update this model's measured rate
            rate = prefilled / seconds
            old = self.prefill_rate.get(ns)
            self.prefill_rate[ns] = rate if old is None else 0.7 * old + 0.3 * rate

    def as_stats(self) -> dict:
        return {f"engine_{k}": v for k, v in self.counters.items()}


def cached_stats(cached: int, source: str | None) -> dict:
    """The cached prefix's part of a generation's stats: how long, from which tier."""
    return {"cached_tokens": cached, "cache_source": source, "ram_tokens": cached if source == "ram" else 0,
            "ssd_tokens": cached if source == "ssd" else 0, "remote_tokens": cached if source == "remote" else 0}


def generation_stats(*, prompt_tokens, cached, source, prefilled, lookup_s, prefill_s, t0, token_times,
                     decode_tokens, finish_reason, peak_memory) -> dict:
    """One generation's `GenerationResult.stats`.

    Decode speed is (n - 1) tokens over the time from the first to the last
    token (mlx-lm's generation_tps counts n over that interval).
    """
    n = len(token_times)
    span = token_times[-1] - token_times[0] if n > 1 else 0.0
    return {
        "prompt_tokens": prompt_tokens,
        **cached_stats(cached, source),
        "prefilled_tokens": prefilled,
        "lookup_s": lookup_s,
        "prefill_s": prefill_s,
        "prefill_tokens_per_s": (prefilled / prefill_s) if prefilled and prefill_s > 0 else None,
        "ttft_s": token_times[0] - t0 if token_times else None,
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": (n - 1) / span if span > 0 else None,
        "total_s": (token_times[-1] - t0) if token_times else None,
        "finish_reason": finish_reason,
        "peak_memory_bytes": peak_memory,
    }


class AccessTrace:
    """One JSON line per generation, for replaying retention policies offline
    (benchmarks/bench_retention.py): namespace, prompt token ids, how many
    tokens the published state holds, KV bytes per token, the prefill rate.

    Off unless a path is given (MLXCACHE_TRACE). The file holds prompts: 0600.
    """

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path).expanduser() if path else None

    def record(self, ns: str, prompt: list, kept: int, kv_bytes_per_token: float, prefill_tokens_per_s) -> None:
        if self.path is None:
            return
        line = json.dumps({"ns": ns, "prompt": prompt, "kept": kept, "kv_bytes_per_token": kv_bytes_per_token,
                           "prefill_tokens_per_s": prefill_tokens_per_s})
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(line + "\n")
