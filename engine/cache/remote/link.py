"""The remote tier as the tiered cache sees it: a lookup that returns a
Checkpoint, and publication of what the SSD tier committed.

Lookup order is RAM, SSD, remote (tiered.py). A remote prefix is either the
run of leading full blocks the remote holds chain records for (token
spans: plain, quantized, unwrapped sliding-window and unchunked layers), or
an exact checkpoint (recurrent state, a wrapped ring) whose tokens are a
prefix of the prompt (remote/records.py). It is fetched only when it is
longer than what the local tiers serve and the measured remote bandwidth
beats prefilling those tokens; then every value is read with its size
bounded, verified by BLAKE3, and rebuilt in MLX buffers (rebuild.py),
and the checkpoint is adopted in RAM and written through to the local SSD
tier by the caller.

A lookup has a deadline derived from the prefill it would replace (the
candidate tokens at the measured prefill rate, over the margin a fetch must
win by, at least MIN_DEADLINE_S): past it the remote is abandoned. Until
that model's prefill rate is measured the rate is a guess, so the deadline
is capped at UNMEASURED_DEADLINE_S (a first cell never waits ~15x its
prefill on a stalled server). A call cut at its deadline (a paused server,
a dripping reply) opens the breaker at once (client.py). Any
failure is a miss (RemoteMiss or None), never a failed generation.

Publication runs after a local commit (the writer thread calls
`published`): it queues a job on the remote publisher, which reads the
block files (and, for an exact state, the manifest) and uploads only what
the remote lacks. Owner thread for `lookup`.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Sequence

from ...kv.checkpoint import Checkpoint
from ..objects import remote as object_remote
from ..objects.cache import REVISION as OBJECT_REVISION, is_object_namespace
from .credentials import RemoteSettings
from .origins import Origin, Origins
from .publish import Value
from .tier import Found, RemoteMiss, RemoteTier
from .rebuild import Manifest, build_spans, parse_layout
from ..ssd import blocks
from ..ssd import format as fmt
from ...kv import first_layer, recompute
from . import verify

PUBLISH_MODES = ("all", "named", "none")
ORIGINS_DIR = "remote-origins"  # beside the catalogue: origins.py
DEFAULT_PREFILL_TOKENS_PER_S = 100.0  # until this namespace's prefill rate is measured
MIN_DEADLINE_S = 0.5  # a lookup may always take this long (a loaded machine, a far server)
UNMEASURED_DEADLINE_S = 2.0  # the most a lookup waits while the prefill rate it replaces is a guess
log = logging.getLogger(__name__)
_warned: set = set()  # URLs already warned about being unauthenticated (once per process)


class RemoteLink:
    def __init__(self, tier: RemoteTier, *, publish: str = "all",
                 prefill_rate: Callable[[str], float | None] = lambda ns: None,
                 is_named: Callable[[str, tuple], bool] = lambda ns, tokens: False,
                 exact: Callable[[str], bool] = lambda ns: False, origins: Origins | None = None,
                 bound: Callable[[str, Checkpoint, Any], bool | None] = lambda ns, cp, early: None,
                 ahead: Callable[[str, Sequence[int]], Any] = lambda ns, tokens: None,
                 converts: Callable[[str], bool] = lambda ns: False):
        """exact(ns): whether that namespace's states may be exact-only (recurrent, ring layers):
        then lookups also read exact records. converts(ns): whether its KV converts at an offset
        (kv_start): then lookups also read the converted chain. origins: where remote-made entries are remembered.
        bound(ns, cp, early): whether cp's KV belongs to its tokens (kv/first_layer.py; None: cannot tell),
        with `early` what ahead(ns, tokens) began for the tokens a fetch is expected to cover (its
        reference computed while the blocks are read)."""
        if publish not in PUBLISH_MODES:
            raise ValueError(f"remote publish must be one of {', '.join(PUBLISH_MODES)}, not {publish!r}")
        self.tier, self.publish_mode = tier, publish
        self.prefill_rate, self.is_named, self.exact, self.bound, self.ahead = prefill_rate, is_named, exact, bound, ahead
        self.converts = converts
        self.counters = {f"remote_{k}": 0 for k in link_counter_names()}
        self.counters["remote_fetch_seconds"] = 0.0
        self.origins = origins if origins is not None else Origins(None)
        self._writer = ""  # the writer id (hex) of the last fetch's records, for its origin
        self._record: dict = {}  # what that writer signed (the evidence if the state proves wrong)
        self.verifier: verify.Verifier | None = None  # states on probation until recomputed here (verify.py)

    def trusted(self, o: Origin) -> bool:
        """Is a remote-made entry still trusted: its secret still configured, its writer still listed?"""
        writers, v = self.tier.writers, self.verifier
        return (o.key_id in self.tier.spaces and (not writers or (o.writer != "" and writers.allows(o.writer)))
                and (v is None or v.trusts(o.writer, o.key_id)))

    # --- lookup (owner thread) ---

    def lookup(self, prompt: Sequence[int], ns: str, have: int) -> Checkpoint | None:
        """A checkpoint of the longest remote prefix of `prompt` (at most len-1 tokens)
        if it is longer than `have` and worth fetching; None otherwise, RemoteMiss on a failed read."""
        bt, cap = blocks.BLOCK_TOKENS, len(prompt) - 1
        candidate = cap // bt * bt - have
        if candidate < self.tier.min_fetch_tokens:  # too short to beat a prefill: no round trip
            return None
        measured = self.prefill_rate(ns)
        rate = measured or DEFAULT_PREFILL_TOKENS_PER_S
        allowed = max(MIN_DEADLINE_S, candidate / rate / self.tier.margin)
        deadline = time.monotonic() + (allowed if measured else min(allowed, UNMEASURED_DEADLINE_S))
        t0 = time.perf_counter()
        try:
            found = self.tier.probe(ns, prompt[:cap], bt, deadline=deadline, exact=self.exact(ns),
                                    converted=self.converts(ns))
            x = found.exact if found.exact is not None and found.exact.length(bt) > have else None
            n_plain = len(found.records) * bt
            if x is not None and x.length(bt) > n_plain:
                cp, early = self._fetch_exact(prompt, ns, have, found, rate, deadline)
            elif n_plain > have:
                cp, early = self._fetch_spans(prompt, ns, have, found, rate, deadline)
            else:
                return None
        except RemoteMiss:
            self.counters["remote_misses"] += 1
            raise
        except Exception as e:  # noqa: BLE001 - the remote tier never fails a generation
            log.warning("remote lookup failed", exc_info=True)
            self.counters["remote_misses"] += 1
            raise RemoteMiss(f"remote lookup failed: {type(e).__name__}: {str(e)[:200]}") from None
        if cp is not None:
            self._verdicts(ns, cp, found.key_id)
            try:  # (the check's evaluation, the origin's file: failing, a miss, never an unchecked hit)
                matches = self.bound(ns, cp, early)
                if matches is not False:
                    self.origins.add(ns, cp.tokens, self._writer, found.key_id)  # before its write-through commits
            except Exception as e:  # noqa: BLE001 - the remote tier never fails a generation
                log.warning("remote hit not checked", exc_info=True)
                self.counters["remote_misses"] += 1
                raise RemoteMiss(f"remote KV of {len(cp)} tokens could not be checked: {type(e).__name__}: "
                                 f"{str(e)[:200]}") from None
            if matches is False:
                self.counters["remote_misses"] += 1
                self.counters["remote_kv_mismatch"] += 1
                raise RemoteMiss(f"remote KV of {len(cp)} tokens: its first layer is not that of its tokens (a "
                                 "forged or mislabelled block); prefilling")
            self.counters["remote_kv_checked" if matches else "remote_kv_unchecked"] += 1
            self._sample(ns, cp, found.key_id)
            self.counters["remote_hits"] += 1
            self.counters["remote_tokens"] += len(cp)
            self.counters["remote_fetch_seconds"] += time.perf_counter() - t0
        return cp

    def _verdicts(self, ns: str, cp: Checkpoint, key_id: str) -> None:
        """A writer this machine caught serving wrong KV is not read again (verify.py)."""
        if self.verifier is not None and not self.verifier.trusts(self._writer, key_id):
            self.verifier.counters["remote_distrusted"] += 1
            self.counters["remote_misses"] += 1
            raise RemoteMiss("remote KV by a writer this machine caught serving wrong KV: not used")

    def _sample(self, ns: str, cp: Checkpoint, key_id: str) -> None:
        """The fetch-time check across all layers (a few positions, kv/recompute.py), then probation."""
        v = self.verifier
        if v is None:
            return
        t0 = time.perf_counter()
        try:
            verdict = recompute.sampled_check(v.model_of(ns), cp, v.sampled_positions) if v.sampled_positions else None
        except Exception:  # noqa: BLE001 - the sample is a cheap extra: the idle recomputation still decides
            log.warning("sampled check failed", exc_info=True)
            verdict = None
        v.counters["remote_sample_seconds"] += time.perf_counter() - t0
        v.counters["remote_sampled" if verdict is not None else "remote_sample_unchecked"] += 1
        if isinstance(verdict, recompute.Mismatch):
            self.counters["remote_misses"] += 1
            v.forged(ns, cp, self._writer, key_id, self._record, verdict)
            raise RemoteMiss(f"remote KV of {len(cp)} tokens is not what this model computes at "
                             f"{recompute.describe(verdict)}: not used")
        v.add(ns, cp, self._writer, key_id, self._record)

    def served(self, loan, ns: str):
        """A RAM loan of a state still on probation is told as the remote's (and this cell used it)."""
        if loan is not None and self.verifier is not None and self.verifier.holds(ns, loan.entry.tokens[:loan.length]):
            loan.source = "remote"
            self.verifier.used(ns, loan.entry.tokens[:loan.length])
        return loan

    def _ahead(self, ns: str, tokens) -> Any:
        """The first-layer check's sample of `tokens`, started while the blocks are read (None if not)."""
        try:
            return self.ahead(ns, tokens)
        except Exception:  # noqa: BLE001 - the check is then computed after the fetch
            log.debug("first-layer sample not computed ahead", exc_info=True)
            return None

    def _fetch_spans(self, prompt, ns, have, found: Found, rate, deadline) -> tuple[Checkpoint | None, Any]:
        bt, records = blocks.BLOCK_TOKENS, found.records
        layout = parse_layout(found.layout, bt)
        if layout is None:
            self.tier.count(malformed=1)
            raise RemoteMiss("a remote record has a layout this build cannot use")
        if not self.tier.worth_fetching(records[-1].end - have, layout.data_bytes / bt, rate, block_size=bt):
            self.counters["remote_skipped"] += 1
            return None, None
        names = [r.block for r in records]
        fetch = self.tier.start_blocks([(r.block, layout.block_bytes(r.index)) for r in records],
                                       key_id=found.key_id, deadline=deadline)
        early = None if layout.min_reusable_offset else self._ahead(ns, prompt[:len(records) * bt])  # (quantized: unchecked)
        try:
            values = fetch.result()
        except RemoteMiss as e:  # a shorter run of verified blocks may still be worth it
            values = e.blocks
            self.counters["remote_misses"] += 1
        n = len(values) * bt
        if n < layout.min_reusable_offset:  # converted KV, and a block before its start is gone: serves nothing
            return None, None
        layers = layout.layers_at(n) if n > have else None
        if layers is None:
            if n > have:
                self.tier.count(malformed=1)
                raise RemoteMiss("the remote layout's layers cannot be cut to its blocks")
            return None, None
        try:
            cp = build_spans(prompt[:n], layout, layers, values, names)
        except Exception as e:  # noqa: BLE001 - layers from another build: whatever the codecs raise is a miss
            self.tier.count(malformed=1)
            raise RemoteMiss(f"remote blocks do not rebuild a checkpoint: {type(e).__name__}: {e}") from None
        self.tier.touch(found.key_id, found.chain[:len(values)], None, names[:len(values)], found.converted,
                        records[-1].layout_id)
        self._writer, last = found.writer, records[len(values) - 1]
        self._record = {"prefix_key": _hex(found.chain[len(values) - 1]), "signature": _hex(last.signature),
                        "signed_head": _hex(last.head), "blocks": names[:len(values)]}
        return cp, early

    def _fetch_exact(self, prompt, ns, have, found: Found, rate, deadline) -> tuple[Checkpoint | None, Any]:
        bt, x = blocks.BLOCK_TOKENS, found.exact
        n = x.length(bt)
        if not self.tier.worth_fetching(n - have, x.nbytes / n, rate, block_size=bt):
            self.counters["remote_skipped"] += 1
            return None, None
        value, = self.tier.get_blocks([(x.manifest, x.size)], key_id=found.key_id, deadline=deadline)
        try:
            manifest = Manifest(value, ns, prompt[:n])
        except ValueError as e:
            self.tier.count(malformed=1)
            raise RemoteMiss(f"remote state of {n} tokens: {e}") from None
        try:
            items = manifest.block_items()
            if x.size + sum(s for _, s in items) != x.nbytes:
                self.tier.count(malformed=1)
                raise RemoteMiss("a remote exact record and its manifest disagree on its size")
            # (a state past kv_start has quantized layers: its first layer is not checked)
            fetch = self.tier.start_blocks(items, key_id=found.key_id, deadline=deadline)
            early = None if manifest.header.min_reusable_offset else self._ahead(ns, prompt[:n])
            values = fetch.result()
            try:
                cp = manifest.build(values)
            except Exception as e:  # noqa: BLE001 - layers from another build: whatever the codecs raise is a miss
                self.tier.count(malformed=1)
                raise RemoteMiss(f"remote state does not rebuild a checkpoint: {type(e).__name__}: {e}") from None
        finally:
            manifest.close()
        self.tier.touch(found.key_id, found.chain[:x.index + 1], found.chain[x.index], [x.manifest] + [
            name for name, _ in items])
        self._writer = x.writer
        self._record = {"exact_manifest": x.manifest, "blocks": [name for name, _ in items]}
        return cp, early

    # --- publication (writer thread) ---

    def published(self, info: fmt.FileInfo, blocks_root) -> None:
        """After a local commit: queue the checkpoint for the remote (its full blocks, or the exact state)."""
        h = info.header
        if self.origins.derived(h.namespace, h.tokens) is not None:
            self.counters["remote_not_republished"] += 1  # another writer's: never published as this one's
            return
        if not self.tier.may_publish or self.publish_mode == "none" or (self.publish_mode == "named" and not self.is_named(h.namespace, h.tokens)):
            return
        if is_object_namespace(h.namespace):  # an exact tensor object (Engine.objects): cache/objects/remote.py
            if object_remote.publish(self.tier, info, OBJECT_REVISION):
                self.counters["remote_published"] += 1
            return
        bt = blocks.BLOCK_TOKENS
        spans = span_publication(info, blocks_root)
        if spans is not None:  # token spans: any prefix serves
            if not spans[0]:
                return
            queued = self.tier.publish(h.namespace, h.tokens, bt, *spans)
        elif h.version == fmt.FORMAT_VERSION and len(h.tokens) >= bt:  # exact at its own length only
            queued = self.tier.publish_exact(h.namespace, h.tokens, bt, [_value(b, blocks_root) for b in h.blocks],
                                             lambda p=info.path: p.read_bytes())
        else:
            return
        if queued:
            self.counters["remote_published"] += 1


def _hex(x) -> str:
    return x.hex() if isinstance(x, (bytes, bytearray)) else str(x)


def _value(b, blocks_root) -> Value:
    return Value(b.name, b.nbytes, lambda p=blocks.block_path(blocks_root, b.name): p.read_bytes())


def span_publication(info: fmt.FileInfo, blocks_root) -> tuple[list, dict] | None:
    """(its leading full blocks as Values, their layout) for a committed checkpoint of token spans;
    None for one exact only at its own length. The blocks are [] when it has none from token 0.
    A checkpoint reusable only from an offset (KV converted at kv_start) says so in its layout, and
    is exact only at its own length when its full blocks end before that offset."""
    h, bt = info.header, blocks.BLOCK_TOKENS
    if h.inline or not h.blocks or not h.trimmable:
        return None
    full = [b for b in h.blocks if b.end - b.start == bt and b.start % bt == 0]
    if not full or full[0].start != 0:
        return ([], {}) if not h.min_reusable_offset else None
    if len(full) * bt < h.min_reusable_offset:
        return None
    layout = {"tensors": [[t.name, t.dtype, list(t.shape[:-2]) + [bt, t.shape[-1]]] for t in h.span_tensors],
              "layers": h.layout}
    if h.min_reusable_offset:
        layout["min_reusable_offset"] = h.min_reusable_offset
    return [_value(b, blocks_root) for b in full], layout


def attach(cache, settings: RemoteSettings, *, publish: str = "all",
           prefill_rate: Callable[[str], float | None] = lambda ns: None,
           exact: Callable[[str], bool] = lambda ns: False, model_of: Callable[[str], Any] = lambda ns: None,
           emit: Callable[..., object] = lambda *a, **k: None) -> RemoteLink:
    """Connect `cache` (a TieredPromptCache) to a remote tier: lookups fall back to it (checked and
    verified against model_of(ns), the loaded model of a namespace), committed checkpoints are
    published to it. A bad URL raises ValueError (redacted)."""
    tier = RemoteTier(settings.url, secret=settings.secret, insecure=settings.insecure, password=settings.password,
                      tls=settings.tls, signing_key=settings.signing_key, writers=settings.writers)
    store = cache.store
    origins = Origins(None if store is None else store.root / ORIGINS_DIR)
    link = RemoteLink(tier, publish=publish, prefill_rate=prefill_rate, exact=exact, origins=origins,
                      bound=lambda ns, cp, early: first_layer.bound_to_tokens(model_of(ns), cp, early),
                      ahead=lambda ns, tokens: first_layer.ahead(model_of(ns), tokens),
                      converts=lambda ns: bool(getattr(model_of(ns), "kv_start", 0)),
                      is_named=lambda ns, tokens: cache.store is not None and cache.store.is_pinned(ns, tokens))
    link.verifier = verify.attach(cache, link, model_of, None if store is None else store.root / verify.EVIDENCE_DIR,
                                  emit)
    dropped = origins.sweep(link.trusted, None if store is None else lambda keys: store.remove(keys, "revoked"))
    link.counters["remote_revoked_dropped"] += dropped
    if dropped:
        log.warning("remote tier: dropped %d local entries from revoked writers or secrets", dropped)
    if not tier.authenticated and tier.url not in _warned:
        _warned.add(tier.url)
        warnings.warn(f"mlxcache: the remote tier {tier.url} is UNAUTHENTICATED (remote_insecure): anyone who can "
                      "write to that server can plant KV your prompts will load. Set a team secret "
                      "(MLXCACHE_REMOTE_SECRET_FILE) to authenticate it.", stacklevel=3)
    cache.remote = link
    if cache.writer is not None:
        cache.writer.on_committed = lambda info: link.published(info, cache.store.blocks_root)
    return link


def flush(link: RemoteLink | None, timeout: float | None) -> list[str]:
    """Wait for queued publications; their failures (credentials removed)."""
    return [] if link is None else link.tier.wait(timeout)


def close(link: RemoteLink | None, timeout: float) -> list[str]:
    """Wait at most `timeout` for queued publications, then stop: failures, and what was not published."""
    return [] if link is None else link.tier.close(timeout)


_TIER_KEYS = ("publish_pending", "publish_failed", "blocks_uploaded", "blocks_skipped", "bytes_read", "bytes_written",
              "mac_rejected", "malformed", "stale", "wrong_size", "bad_blocks", "deadline_missed", "errors",
              "unknown_writer", "signature_rejected", "tombstoned", "layout_missing",
              "get_bandwidth_bytes_per_s", "latency_s")


def remote_stats(link: RemoteLink | None) -> dict:
    """The remote_* keys of Engine.stats() (metrics.SCHEMA): zeros and None while the tier is off."""
    if link is None:
        out = {f"remote_{k}": 0 for k in (*link_counter_names(), *_TIER_KEYS)}
        out.update(verify.zero_counters())
        out.update(remote_url=None, remote_publish=None, remote_state=None, remote_last_error=None,
                   remote_get_bandwidth_bytes_per_s=None, remote_latency_s=None, remote_fetch_seconds=0.0,
                   remote_auth=None)
        return out
    t = link.tier.stats()
    out = dict(link.counters)
    out.update({f"remote_{k}": t.get(k) for k in _TIER_KEYS})
    who = (f"; writers: {t['writers']} allow-listed" if t["writers"] else "; writers: any holder of the secret") + (
        ", signing" if t["signing"] else ", not signing (read-only)" if t["writers"] else "")
    auth = (f"keyed (key id {t['key_id']}){who}" if t["authenticated"]
            else "UNAUTHENTICATED (remote_insecure): anyone who can write to the server can plant KV")
    out.update(link.verifier.counters if link.verifier is not None else verify.zero_counters())
    out.update(remote_url=t["url"], remote_publish=link.publish_mode, remote_state=t["breaker"],
               remote_last_error=t["last_error"], remote_auth=auth)
    return out


def link_counter_names() -> tuple:
    return ("hits", "tokens", "misses", "skipped", "published", "not_republished", "revoked_dropped", "kv_checked",
            "kv_unchecked", "kv_mismatch")
