"""Passages placed from their own KV (generate/passages/): the two ends of the recompute fraction are
what they claim. 100% recomputed is the full prefill of the same prompt (within float rounding), at
every layer and in the tokens decoded; 0% is each passage's own encoding moved to its positions,
checked against the model's own forward pass over the lead-in and the passage at those positions
(attention sees relative positions only, so that is the passage alone, moved). In between, the
chosen tokens and nothing else differ from the 0% state, and they come closer to the full prefill.
Rotary codes with scaling (linear, Llama 3), traditional layout and other attention families move too."""

from __future__ import annotations

import mlx.core as mx
import pytest
from tiny_archs import build_arch_model
from tiny_model import build_tiny_model

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.generate.passages import blend
from mlxcache_kernel.engine.generate.passages.blend import LEAD_TOKENS
from mlxcache_kernel.engine.generate.passages.prompt import passage_prompt
from mlxcache_kernel.engine.generate.passages.run import place_passages
from mlxcache_kernel.engine.generate.prefill import prefill
from mlxcache_kernel.engine.kv.caches import kv_arrays

PASSAGES = ["The harbour master counted forty ships before the storm came in from the west.",
            "Mountains north of the river hold snow until late June, feeding the mills below.",
            "A lighthouse keeper wrote every night: wind, ships seen, oil burned, and the tides.",
            "Grain from the valley went by barge to the coast, three days in a dry summer."]
QUESTION = "Which ships are mentioned, and when?"
SYSTEM = "You answer from the passages."  # a head unlike the lead-in: every passage moves
RTOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("passage-models")
    return {"llama": build_tiny_model(root / "llama"),
            "llama-scaled": build_arch_model("llama", root / "scaled", rope_traditional=True,
                                             rope_scaling={"type": "linear", "factor": 2.0}),
            "llama3-rope": build_arch_model("llama", root / "llama3", rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
            "qwen2": build_arch_model("qwen2", root / "qwen2"),
            "gemma2": build_arch_model("gemma2", root / "gemma2"),
            "llama-3-layers": build_tiny_model(root / "deeper", layers=3)}


@pytest.fixture
def eng(tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as e:
        yield e


def full_prefill(m, tokens: list) -> list:
    caches = m.new_caches()
    prefill(m.model, caches, tokens, chunk=512)
    return [kv_arrays(c) for c in caches]


def state(placed) -> list:
    return [kv_arrays(c) for c in placed.caches]


def close(a, b, rtol=RTOL) -> bool:
    scale = float(mx.abs(b).max().item()) or 1.0
    return float(mx.abs(a - b).max().item()) <= rtol * scale


def place(eng, m, passages, fraction, system=SYSTEM):
    return place_passages(eng._services, eng.objects, m, QUESTION, passages, fraction=fraction, system=system)


class _Offset:
    """A plain cache whose first token sits at `offset` (the model's rotary code reads it), for the
    independent reference: the lead-in and one passage, moved."""

    def __init__(self, offset: int):
        self.offset, self.keys, self.values = offset, None, None

    def make_mask(self, n, *args, **kwargs):  # (an array: gemma2's attention takes no "causal")
        return mx.arange(n)[:, None] >= mx.arange(n)[None] if n > 1 else None

    def update_and_fetch(self, k, v):
        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=-2)
        self.values = v if self.values is None else mx.concatenate([self.values, v], axis=-2)
        self.offset += k.shape[-2]
        return self.keys, self.values


@pytest.mark.parametrize("arch", ["llama", "llama-scaled", "llama3-rope", "qwen2", "gemma2"])
def test_all_recomputed_is_the_full_prefill(eng, models, arch):
    eng.load_model(str(models[arch]), name=arch)
    m = eng.models.get(arch)
    order = [PASSAGES[2], PASSAGES[0], PASSAGES[3]]
    place(eng, m, PASSAGES[:3], 0.0)  # stores three of them, at other positions
    tokens, placed = place(eng, m, order, 1.0)
    assert placed.figures["passages_reused"] == 2 and placed.figures["approximate"] is False
    assert placed.figures["passage_recomputed_share"] == 1.0
    ref = full_prefill(m, tokens[: placed.length])
    for (k, v), (rk, rv) in zip(state(placed), ref):
        assert k.shape == rk.shape and close(k, rk) and close(v, rv)
    r = eng.generate(QUESTION, passages=order, recompute=1.0, system=SYSTEM, max_tokens=10, model=arch)
    plain = eng.generate("\n\n".join(order) + "\n\n" + QUESTION, system=SYSTEM, max_tokens=10, model=arch,
                         use_cache=False)
    assert r.tokens == plain.tokens and r.prompt_tokens == plain.prompt_tokens


@pytest.mark.parametrize("arch", ["llama", "llama-scaled", "llama3-rope", "gemma2"])
def test_none_recomputed_is_each_passage_encoded_alone_and_moved(eng, models, arch):
    eng.load_model(str(models[arch]), name=arch)
    m = eng.models.get(arch)
    order = [PASSAGES[3], PASSAGES[1], PASSAGES[0]]
    tokens, placed = place(eng, m, order, 0.0)
    assert placed.figures["passage_tokens_recomputed"] == 0 and placed.figures["approximate"] is True
    pp = passage_prompt(m.tokenizer, QUESTION, order, system=SYSTEM)
    got, ref = state(placed), full_prefill(m, tokens[: pp.spans[0][0]])
    for (k, v), (rk, rv) in zip(got, ref):  # the head is exact
        assert close(k[..., : rk.shape[-2], :], rk) and close(v[..., : rv.shape[-2], :], rv)
    n_lead = len(pp.lead_in)
    for s, e in pp.spans:
        caches = [_Offset(s - n_lead) for _ in got]
        m.model(mx.array(pp.lead_in + tokens[s:e])[None], cache=caches)
        for (k, v), c in zip(got, caches):
            assert close(k[..., s:e, :], c.keys[..., n_lead:, :]) and close(v[..., s:e, :], c.values[..., n_lead:, :])
        assert not close(got[-1][0][..., s:e, :], full_prefill(m, tokens[:e])[-1][0][..., s:e, :], rtol=1e-3)


def test_a_fraction_recomputes_the_chosen_tokens_and_comes_closer(eng, models):
    eng.load_model(str(models["llama"]), name="m")
    m = eng.models.get("m")
    order = [PASSAGES[1], PASSAGES[2], PASSAGES[0], PASSAGES[3]]
    tokens, none = place(eng, m, order, 0.0)
    _, some = place(eng, m, order, 0.3)
    pp = passage_prompt(m.tokenizer, QUESTION, order, system=SYSTEM)
    placed = sum(e - s for s, e in pp.spans)
    assert some.figures["passage_tokens_recomputed"] == round(0.3 * placed)
    assert some.figures["passages_reused"] == 4 and some.figures["approximate"] is True
    k0, k1 = state(none)[-1][0], state(some)[-1][0]
    differs = mx.abs(k1 - k0).max(axis=(0, 1, 3)).tolist()
    changed = {p for p, d in enumerate(differs) if d > 1e-6}
    assert changed and len(changed) <= some.figures["passage_tokens_recomputed"]
    assert all(s + r in changed for s, e in pp.spans for r in range(min(LEAD_TOKENS, e - s)))  # first tokens first
    ref = full_prefill(m, tokens[: none.length])[-1][0]
    err = [float(mx.abs(k - ref).sum().item()) for k in (k0, k1)]
    assert err[1] < err[0]


def test_a_first_passage_after_exactly_the_lead_in_is_exact(eng, models):
    """No system prompt: the head is the lead-in, so the first passage sits where it was computed."""
    eng.load_model(str(models["llama"]), name="m")
    m = eng.models.get("m")
    tokens, placed = place(eng, m, PASSAGES[:3], 0.0, system=None)
    pp = passage_prompt(m.tokenizer, QUESTION, PASSAGES[:3])
    s, e = pp.spans[0]
    assert placed.figures["passage_tokens_exact"] == e - s
    for (k, _), (rk, _) in zip(state(placed), full_prefill(m, tokens[:e])):
        assert close(k[..., :e, :], rk)


def test_the_layers_before_the_deviation_layer_are_recomputed_for_every_placed_token(eng, models, monkeypatch):
    """Measuring how far each token's KV moves at layer 2 recomputes layers 0 and 1 for all of them on the
    way: those layers are the full prefill's; layer 2 differs where a token was not chosen."""
    monkeypatch.setattr(blend, "DEVIATION_LAYER", 2)
    eng.load_model(str(models["llama-3-layers"]), name="m")
    m = eng.models.get("m")
    tokens, some = place(eng, m, [PASSAGES[3], PASSAGES[1], PASSAGES[0]], 0.3)
    got, ref = state(some), full_prefill(m, tokens[: some.length])
    assert close(got[1][0], ref[1][0]) and close(got[1][1], ref[1][1])
    assert not close(got[2][0], ref[2][0], rtol=1e-3)


def test_drafts_over_placed_passages_decode_what_plain_decoding_does(eng, models):
    """The placed state is the start; a draft model (its own exact state of the prompt) and drafts from the
    context only decide how many tokens a forward yields."""
    eng.load_model(str(models["llama"]), name="m")
    kw = dict(passages=PASSAGES[:3], system=SYSTEM, recompute=0.3, max_tokens=12)
    plain = eng.generate(QUESTION, lookup=False, **kw)
    drafted = eng.generate(QUESTION, draft="m", **kw)
    assert drafted.stats["draft_tokens_proposed"] > 0 and drafted.tokens == plain.tokens
    assert eng.generate(QUESTION, lookup=True, **kw).tokens == plain.tokens
