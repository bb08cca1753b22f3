"""Property tests of the RAM tier against a small reference model."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache

from mlxcache_kernel.engine.kv.checkpoint import Checkpoint
from mlxcache_kernel.engine.kv.layers import LayerState
from mlxcache_kernel.engine.cache.ram import RamTier

BYTES_PER_TOKEN = 2 * 2 * 4  # keys + values, (1, 1, n, 2) float32


def make_checkpoint(tokens, trimmable=True) -> Checkpoint:
    n = len(tokens)
    if trimmable:
        k = mx.arange(n * 2, dtype=mx.float32).reshape(1, 1, n, 2)
        layer = LayerState.whole("KVCache", (k, k + 1), {"offset": n})
    else:  # a wrapped rotating window: serves its exact boundary only
        size = max(1, n - 1)
        k = mx.zeros((1, 1, size, 2))
        layer = LayerState.whole("RotatingKVCache", (k, k), {"offset": n, "keep": 0, "max_size": size, "idx": size})
    return Checkpoint(tuple(tokens), (layer,), n * BYTES_PER_TOKEN)


class Reference:
    """The semantics, written as plainly as possible."""

    def __init__(self, budget):
        self.budget = budget
        self.entries = {}  # (ns, tokens) -> [trimmable, last_used]
        self.clock = itertools.count()

    def usable(self, tokens, trimmable, prompt):
        m = 0
        while m < min(len(tokens), len(prompt)) and tokens[m] == prompt[m]:
            m += 1
        m = min(m, len(prompt) - 1)
        if m < 1:
            return 0
        return m if (m == len(tokens) or trimmable) else 0

    def take(self, prompt, ns):
        best, best_key = 0, None
        for (e_ns, tokens), (trimmable, used) in self.entries.items():
            if e_ns != ns:
                continue
            n = self.usable(tokens, trimmable, prompt)
            key = (n, n == len(tokens), used)
            if n > 0 and (best_key is None or key > best_key):
                best, best_key, best_tokens = n, key, tokens
        if best:
            self.entries[(ns, best_tokens)][1] = next(self.clock)
        return best

    def put(self, tokens, ns, trimmable):
        nbytes = len(tokens) * BYTES_PER_TOKEN
        self.entries.pop((ns, tokens), None)
        if nbytes > self.budget:
            return
        if trimmable:
            for e_ns, other in list(self.entries):
                if e_ns == ns and len(other) < len(tokens) and tokens[: len(other)] == other:
                    del self.entries[(e_ns, other)]
        self.entries[(ns, tokens)] = [trimmable, next(self.clock)]
        while self.used() > self.budget:
            victim = min(self.entries, key=lambda k: self.entries[k][1])
            del self.entries[victim]

    def used(self):
        return sum(len(t) * BYTES_PER_TOKEN for _, t in self.entries)


token_lists = st.lists(st.integers(0, 3), min_size=1, max_size=8).map(tuple)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("put"), token_lists, st.sampled_from(["a", "b"]), st.booleans()),
        st.tuples(st.just("take"), token_lists, st.sampled_from(["a", "b"]), st.just(None)),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, budget=st.integers(4, 24).map(lambda t: t * BYTES_PER_TOKEN))
def test_ram_tier_matches_reference(ops, budget):
    cache = RamTier(budget)
    ref = Reference(budget)
    for op, tokens, ns, trimmable in ops:
        if op == "put":
            cache.put(make_checkpoint(tokens, trimmable), ns)
            ref.put(tokens, ns, trimmable)
        else:
            lease = cache.take(tokens, ns)
            expected = ref.take(tokens, ns)
            assert (lease.length if lease else 0) == expected
            if lease:
                # The lent views hold exactly the matched prefix, from an entry of this namespace.
                assert lease.entry.ns == ns
                assert lease.entry.tokens[: lease.length] == tokens[: lease.length]
                assert all(c.offset == lease.length for c in lease.caches if hasattr(c, "offset"))
                lease.release()
        assert {(e.ns, e.tokens) for e in cache.entries()} == set(ref.entries)
        assert cache.used_bytes == sum(e.nbytes for e in cache.entries()) == ref.used()
        assert cache.used_bytes <= budget


def test_namespaces_never_cross():
    cache = RamTier(None)
    cache.put(make_checkpoint((1, 2, 3, 4)), "model-a")
    assert cache.take((1, 2, 3, 4, 5), "model-b") is None
    assert cache.take((1, 2, 3, 4, 5), "model-a").length == 4


def test_take_is_capped_so_one_token_is_forwarded():
    cache = RamTier(None)
    cache.put(make_checkpoint((1, 2, 3)), "ns")
    lease = cache.take((1, 2, 3), "ns")
    assert lease.length == 2  # trimmed view of the exact entry
    assert cache.take((1,), "ns") is None


def test_untrimmable_entry_serves_exact_boundary_only_and_keeps_ancestors():
    cache = RamTier(None)
    cache.put(make_checkpoint((1, 2)), "ns")
    cache.put(make_checkpoint((1, 2, 3, 4), trimmable=False), "ns")
    assert {e.tokens for e in cache.entries()} == {(1, 2), (1, 2, 3, 4)}  # ancestor survives
    assert cache.take((1, 2, 3, 4, 9), "ns").length == 4
    assert cache.take((1, 2, 3, 9), "ns").length == 2  # falls back to the ancestor


def test_borrowers_get_views_and_donor_stays_immutable():
    tokens = tuple(range(6))
    live = KVCache()
    live.update_and_fetch(mx.ones((1, 2, 6, 4)), mx.ones((1, 2, 6, 4)))
    cp = Checkpoint.capture(tokens, [live])
    cache = RamTier(None)
    cache.put(cp, "ns")
    donor_keys = np.array(cache.get_exact(tokens, "ns").checkpoint.layers[0].arrays[0])
    lease = cache.take(tokens + (7,), "ns")
    c = lease.caches[0]
    c.update_and_fetch(mx.full((1, 2, 1, 4), 5.0), mx.full((1, 2, 1, 4), 5.0))
    c.trim(3)
    c.update_and_fetch(mx.full((1, 2, 1, 4), 9.0), mx.full((1, 2, 1, 4), 9.0))
    mx.eval(c.keys)
    assert np.array_equal(np.array(cache.get_exact(tokens, "ns").checkpoint.layers[0].arrays[0]), donor_keys)
    assert lease.entry.borrowers == 1
    lease.release()
    assert lease.entry.borrowers == 0


def test_oversized_entry_is_not_stored_and_evicts_nothing():
    cache = RamTier(10 * BYTES_PER_TOKEN)
    cache.put(make_checkpoint((1, 2, 3)), "ns")
    assert cache.put(make_checkpoint(tuple(range(20))), "ns") is None
    assert [e.tokens for e in cache.entries()] == [(1, 2, 3)]
    assert cache.counters["oversized"] == 1


def test_session_index_skips_scan_and_eviction_prefers_unreferenced():
    cache = RamTier(8 * BYTES_PER_TOKEN)
    cache.put(make_checkpoint((1, 2, 3)), "ns", session="chat")
    cache.put(make_checkpoint((5, 6, 7)), "ns")
    assert cache.session_entry("chat", "ns").tokens == (1, 2, 3)
    entry, n = cache.best((1, 2, 3, 4), "ns", session="chat")
    assert (entry.tokens, n) == ((1, 2, 3), 3)
    cache.put(make_checkpoint((8, 9, 9)), "ns")  # over budget: the unreferenced (5,6,7) goes first
    assert {e.tokens for e in cache.entries()} == {(1, 2, 3), (8, 9, 9)}
    cache.drop_session("chat")
    assert cache.session_entry("chat", "ns") is None
    assert cache.get_exact((1, 2, 3), "ns") is not None  # closing drops references, not state


@pytest.mark.parametrize("n", [1, 5])
def test_checkpoint_prefix_and_lend_lengths(n):
    live = KVCache()
    live.update_and_fetch(mx.random.normal((1, 2, 6, 4)), mx.random.normal((1, 2, 6, 4)))
    cp = Checkpoint.capture(range(6), [live], copy=True)
    assert cp.nbytes == 2 * 2 * 6 * 4 * 4
    short = cp.prefix(n)
    assert short.tokens == tuple(range(n))
    assert short.layers[0].arrays[0].shape[2] == n
    assert np.array_equal(np.array(short.layers[0].arrays[0]), np.array(cp.layers[0].arrays[0])[:, :, :n])
