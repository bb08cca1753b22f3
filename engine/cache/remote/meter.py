"""Measured remote speed, and whether fetching a prefix beats recomputing it.

Round-trip latency comes from probes (small pipelined GETs), bandwidth from
block reads (bytes over seconds, round trip included, so the estimate errs
slow). Both are moving averages so a network that changes is followed; the
latency's starts from its prior.
Until something is measured, priors of a 1 Gbit/s LAN are used. Short
prefixes are never worth it: LMCache and SGLang users measured remote hits
slower than recomputing a few hundred tokens once a fetch's fixed costs
(probe, round trips, verification, write-through) are counted.
"""

from __future__ import annotations

import math
import threading

PRIOR_LATENCY_S = 0.001
PRIOR_BANDWIDTH = 100e6  # bytes/s: about a gigabit link
PRIOR_VERIFY_RATE = 5e8  # bytes/s one thread decrypts (AES-GCM) and hashes (BLAKE3) during a fetch: ~1.1 GB/s
# on an idle core here, 0.25-0.5 GB/s while the same two cores receive the transfer (and serve it, on loopback)
MIN_SAMPLE_BYTES = 256 * 1024  # smaller reads say more about latency than bandwidth
ALPHA = 0.3  # weight of the newest sample


class Meter:
    def __init__(self):
        self._lock = threading.Lock()
        self.latency_s: float | None = None
        self.bandwidth: float | None = None  # bytes/s of block reads
        self.verify_rate: float | None = None  # bytes/s the verifying thread opens, measured as it runs

    def round_trip(self, seconds: float) -> None:
        """A probe's round trip. The first is weighed against the prior, not taken whole: it includes
        the connection's setup (connect, AUTH, HELLO), and one slow call (a GC pause, a starved core)
        must not decide alone that no fetch is worth it."""
        with self._lock:
            last = PRIOR_LATENCY_S if self.latency_s is None else self.latency_s
            self.latency_s = (1 - ALPHA) * last + ALPHA * seconds

    def transfer(self, n_bytes: int, seconds: float) -> None:
        self._rate("bandwidth", n_bytes, seconds)

    def verified(self, n_bytes: int, seconds: float) -> None:
        """Values decrypted and hashed by the verifying thread (wall-clock: what a lookup waits for)."""
        self._rate("verify_rate", n_bytes, seconds)

    def verify_seconds(self, n_bytes: int) -> float:
        return n_bytes / (self.verify_rate or PRIOR_VERIFY_RATE)

    def _rate(self, name: str, n_bytes: int, seconds: float) -> None:
        if n_bytes < MIN_SAMPLE_BYTES or seconds <= 0:
            return
        rate = n_bytes / seconds
        with self._lock:
            last = getattr(self, name)
            setattr(self, name, rate if last is None else (1 - ALPHA) * last + ALPHA * rate)

    def fetch_seconds(self, n_bytes: int, round_trips: int) -> float:
        with self._lock:
            lat = PRIOR_LATENCY_S if self.latency_s is None else self.latency_s
            bw = PRIOR_BANDWIDTH if self.bandwidth is None else self.bandwidth
        return round_trips * lat + n_bytes / bw


def fetch_beats_recompute(meter: Meter, n_tokens: int, bytes_per_token: float, prefill_tokens_per_s: float, *,
                          block_size: int, probe_batch: int, get_batch: int, min_tokens: int,
                          margin: float) -> bool:
    """True if fetching `n_tokens` of KV is estimated `margin` times faster than prefilling them."""
    if n_tokens < max(min_tokens, block_size) or bytes_per_token <= 0 or prefill_tokens_per_s <= 0:
        return False
    blocks = n_tokens // block_size
    round_trips = math.ceil(blocks / probe_batch) + math.ceil(blocks / get_batch)
    remote_s = meter.fetch_seconds(int(n_tokens * bytes_per_token), round_trips)
    return remote_s * margin < n_tokens / prefill_tokens_per_s
