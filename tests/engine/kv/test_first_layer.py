"""KV bound to its tokens (issue 30): the first layer's keys and values of a restored prefix are
recomputed from its tokens and compared. A block of another prompt, or of another position, is
caught by the sampled check and confirmed by the whole one; an honest prefix passes the sample."""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np
import pytest

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.kv import first_layer
from mlxcache_kernel.engine.kv.layers import LayerState


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    eng = Engine(cache_dir=tmp_path_factory.mktemp("fl"), ssd=False)
    eng.load_model(tiny_model_dir, name="m")
    yield eng.models.get("m")
    eng.close()


def prefill_layer0(m, ids):
    """Layer 0 of a real chunked prefill (the model's own caches), cut to the prompt."""
    caches = m.new_caches()
    for i in range(0, len(ids), 100):
        m.model(mx.array(ids[i:i + 100])[None], cache=caches)
    c = caches[0]
    k, v = c.keys[..., :len(ids), :], c.values[..., :len(ids), :]
    mx.eval(k, v)
    return LayerState.whole(type(c).__name__, (k, v), {"offset": len(ids)}), (k, v)


def ids_of(n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


def test_an_honest_prefix_passes_the_sample(model):
    ids = ids_of(320, 1)
    layer0, _ = prefill_layer0(model, ids)
    assert first_layer.first_layer_matches(model.model, model.new_caches(), ids, layer0) is True
    assert id(model.model) not in first_layer._whole_only  # the sample itself matched


@pytest.mark.parametrize("how", ["another prompt's block", "a block moved", "one position"])
def test_a_mislabelled_block_is_caught(model, how):
    ids, other = ids_of(320, 1), ids_of(320, 2)
    _, (k, v) = prefill_layer0(model, ids)
    _, (k2, v2) = prefill_layer0(model, other)
    k, v = np.array(k), np.array(v)
    if how == "another prompt's block":
        k[..., 96:128, :], v[..., 96:128, :] = np.array(k2)[..., 96:128, :], np.array(v2)[..., 96:128, :]
    elif how == "a block moved":  # the same tokens' block at another position (a shifted prompt)
        k[..., 96:128, :] = k[..., 160:192, :]
        ids = ids[:96] + ids[160:192] + ids[128:]
    else:
        v[..., 200, :] += 1.0
    k, v = mx.array(k), mx.array(v)
    tol = first_layer.TOLERANCE[mx.float32]
    assert first_layer._whole(model.model, model.new_caches(), ids, k, v, tol) is False
    if how == "one position":  # a sample of 2 in 32 misses it most of the time: the README says so
        return
    assert first_layer._sampled(k, v, first_layer.ahead(model, ids), tol) is False  # any sample catches it
    layer0 = LayerState.whole("KVCache", (k, v), {"offset": len(ids)})
    assert first_layer.first_layer_matches(model.model, model.new_caches(), ids, layer0) is False


def test_layers_it_cannot_check_are_unchecked(model):
    ids = ids_of(64, 3)
    layer0, _ = prefill_layer0(model, ids)
    ring = LayerState("RotatingKVCache", layer0.segments, {})
    assert first_layer.first_layer_matches(model.model, model.new_caches(), ids, ring) is None


def test_a_sample_computed_ahead_checks_only_the_tokens_it_was_computed_for(model):
    """A lookup computes the sample while the blocks are read: the verdicts are the same, and a
    sample of other tokens (the fetch came back shorter, another prompt) is never compared."""
    ids, other = ids_of(320, 1), ids_of(320, 2)
    layer0, (k, v) = prefill_layer0(model, ids)
    caches = model.new_caches()
    early = first_layer.ahead(model, ids)
    assert early is not None and early.is_of(model.model, ids) and not early.is_of(model.model, ids[:-1])
    assert early.is_of(model.model, tuple(ids)) and early.is_of(model.model, np.asarray(ids))  # a checkpoint's, a prompt's
    sampled = set(early.pos.reshape(-1).tolist())
    at, off = min(sampled), min(set(range(len(ids))) - sampled)
    swapped = lambda i: [*ids[:i], ids[i] + 1, *ids[i + 1:]]  # noqa: E731
    assert not early.is_of(model.model, swapped(at))  # another token where the reference was computed
    assert early.is_of(model.model, swapped(off))  # one elsewhere: the reference there depends on nothing else
    assert first_layer.first_layer_matches(model.model, caches, ids, layer0, early) is True
    _, (k2, v2) = prefill_layer0(model, other)
    k, v = np.array(k), np.array(v)
    k[..., 96:128, :], v[..., 96:128, :] = np.array(k2)[..., 96:128, :], np.array(v2)[..., 96:128, :]
    forged = LayerState.whole("KVCache", (mx.array(k), mx.array(v)), {"offset": len(ids)})
    assert first_layer.first_layer_matches(model.model, caches, ids, forged, first_layer.ahead(model, ids)) is False
    # computed for other tokens, or for more of them than came back: recomputed, not compared
    assert first_layer.first_layer_matches(model.model, caches, ids, layer0, first_layer.ahead(model, other)) is True
    short, _ = prefill_layer0(model, ids[:256])
    assert first_layer.first_layer_matches(model.model, caches, ids[:256], short, early) is True
    assert id(model.model) not in first_layer._whole_only  # each honest verdict came from a sample that matched
    assert first_layer.ahead(model, ids[:40]) is None  # too short to sample: checked whole


def test_a_whole_only_mark_is_of_that_model_not_of_its_reused_id(model):
    """A model whose sample failed is checked whole from then on; the mark is of that model object,
    so a model loaded later at the same address (id() is reused once one is freed) is sampled."""
    ids = ids_of(320, 3)
    gone = model.new_caches()  # any object that is not the model: it stands for the freed one
    first_layer._whole_only[id(model.model)] = weakref.ref(gone[0])
    try:
        assert first_layer.ahead(model, ids) is not None  # sampled ahead: not taken for the old model
    finally:
        first_layer._whole_only.pop(id(model.model), None)


def test_the_samples_comparison_is_allclose_without_its_cost():
    """first_layer._all_close stands in for np.allclose on a lookup's path: the same verdicts, NaN
    never close, equal infinities close (a float16 key that overflowed at a sampled position)."""
    rng = np.random.default_rng(5)
    want = rng.standard_normal((3, 64, 16)).astype(np.float32)
    tol = first_layer.TOLERANCE[mx.float32]
    for noise in (0.0, 1e-6, 1e-4, 1e-2):
        got = (want + noise * rng.standard_normal(want.shape)).astype(np.float32)
        assert first_layer._all_close(got, want, tol) == np.allclose(got, want, rtol=tol[0], atol=tol[1])
    inf, nan = want.copy(), want.copy()
    inf[0, 0, 0], nan[1, 2, 3] = np.inf, np.nan
    assert first_layer._all_close(inf, inf.copy(), tol) and not first_layer._all_close(inf, want, tol)
    assert not first_layer._all_close(nan, nan.copy(), tol)
