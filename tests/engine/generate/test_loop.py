"""One token loop (generate/loop.py): every way of generating advances its rows there.

The single row (pipelined), a row with a draft model (verified), shared-prefix and merged batch rows
and scoring's forced rows each go through `loop.run`'s steps, counted by wrapping them (the real
steps still run, and the results are checked against each other); and no other module samples a
token the target keeps.
"""

from __future__ import annotations

import ast
from collections import Counter

import pytest
from repo_paths import ROOT
from tiny_archs import build_arch_model

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.generate import loop


@pytest.fixture
def steps(monkeypatch):
    """Counts of the loop's step kinds, by the forward class that ran them."""
    seen = Counter()
    for name in ("_pipelined", "_verify", "_forced"):
        original = getattr(loop, name)

        def counted(active, forward, *args, _original=original, _name=name):
            seen[(_name, type(forward).__name__)] += 1
            return _original(active, forward, *args)

        monkeypatch.setattr(loop, name, counted)
    return seen


def test_every_way_of_generating_goes_through_the_loop(tiny_model_dir, tmp_path, steps):
    window = build_arch_model("gemma3_text", tmp_path / "window")  # sliding windows: merged batch rows
    with Engine(cache_dir=tmp_path / "c", ram_budget_bytes=1 << 30) as eng:
        eng.load_model(str(tiny_model_dir), name="m")
        eng.load_model(str(window), name="w")
        plain = eng.generate("one two three", model="m", max_tokens=6, use_cache=False, lookup=False)
        assert steps[("_pipelined", "OneRow")] == 1

        drafted = eng.generate("one two three", model="m", max_tokens=6, draft="m", use_cache=False, lookup=False)
        assert drafted.tokens == plain.tokens
        # the first token comes as without a draft (pipelined), then drafts are verified
        assert steps[("_pipelined", "OneRow")] == 2 and steps[("_verify", "OneRow")] >= 1

        looked = eng.generate("one two three", model="m", max_tokens=6, use_cache=False)  # drafts from the context
        assert looked.tokens == plain.tokens and looked.stats["lookup_drafts"]

        rows = eng.generate_batch(["one two three", "four five"], model="m", max_tokens=4, use_cache=False)
        assert rows[0].stats["batch_mode"] == "shared-prefix" and steps[("_verify", "SharedRows")] >= 4

        merged = eng.generate_batch(["one two three", "four five"], model="w", max_tokens=4, use_cache=False)
        assert merged[0].stats["batch_mode"] == "batched" and steps[("_verify", "MergedCaches")] >= 4

        scored = eng.score("one two", [" three", " four five"], model="m", use_cache=False)
        assert steps[("_forced", "SharedRows")] == 1
        assert all(s.logprob < 0 for s in scored)


def _calls(tree: ast.AST, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == name]


def test_only_the_loop_samples_the_tokens_a_row_keeps():
    """`sample` is called by the loop, and by a draft model proposing (its proposals are only kept
    where they equal the loop's own samples); nowhere else."""
    allowed = {"engine/generate/loop.py", "engine/generate/speculative/draft.py", "engine/generate/sampling.py"}
    found = {}
    for path in (ROOT / "engine").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        lines = _calls(ast.parse(path.read_text()), "sample") + _calls(ast.parse(path.read_text()), "sample_logprobs")
        if lines and rel not in allowed:
            found[rel] = lines
    assert not found, f"tokens sampled outside the loop: {found}"
