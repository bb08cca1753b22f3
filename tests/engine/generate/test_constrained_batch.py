"""Constrained answers in batches and with images: each row its own matcher (rows may follow different
schemas, or none), in every batch mode (shared prefix, mlx-lm's merged caches, rows one after
another); a constrained batch from RAM and from SSD in a new process is the batch without the cache;
rows with drafts from their context answer as without; a vision-language model's answer parses."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import pytest
from test_constrained import SCHEMA, Item
from tiny_archs import build_arch_model
from tiny_model import build_tiny_model

from mlxcache_kernel.engine import ConstraintError, Engine

DOC = "A shared instruction that every row of the batch begins with, long enough to be prefilled once. "
QUESTIONS = ["First row?", "Second row, a little longer?", "Third?", "Fourth and last row?"]
PROMPTS = [DOC + q for q in QUESTIONS]
MIXED = dict(response_format=[SCHEMA, Item, None, None], regex=[None, None, "[0-9]{2}-[a-z]{3}", None])
MODES = {"greedy": {}, "seeded": dict(temperature=0.9, seed=4)}
ARCHS = {"llama": "shared-prefix", "gemma3_text": "batched", "llama4": "serial"}  # window; chunked attention


def check_rows(rows) -> None:
    """Row 0 follows SCHEMA, row 1 Item, row 2 the regex, row 3 nothing."""
    assert all(r.stats["finish_reason"] == "eos" for r in rows[:3]), [r.text for r in rows]
    jsonschema.validate(rows[0].parsed, SCHEMA)
    assert isinstance(rows[1].parsed, Item) and re.fullmatch("[0-9]{2}-[a-z]{3}", rows[2].parsed)
    assert rows[3].parsed is None and "constraint" not in rows[3].stats
    assert [r.stats.get("constraint") for r in rows] == ["json", "json", "regex", None]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("constrained_batch")
    return {arch: build_arch_model(arch, root / arch) for arch in ARCHS}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_rows_follow_their_own_constraints_from_the_cache_as_without_it(models, arch, mode, tmp_path):
    kw = dict(max_tokens=200, **MIXED, **MODES[mode])
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(models[arch], name="m")
        off = eng.generate_batch(PROMPTS, use_cache=False, **kw)
        check_rows(off)
        assert {r.stats["batch_mode"] for r in off} == {ARCHS[arch]}
        # each row as `generate` answers it (on these models: a batch's numerics may round apart, docs/batches.md)
        singles = [eng.generate(p, use_cache=False, max_tokens=200, seed=MODES[mode].get("seed", 0) + i,
                                temperature=MODES[mode].get("temperature", 0.0),
                                **{k: v[i] for k, v in MIXED.items() if v[i] is not None})
                   for i, p in enumerate(PROMPTS)]
        assert [s.tokens for s in singles] == [r.tokens for r in off]
        cold = eng.generate_batch(PROMPTS, **kw)
        warm = eng.generate_batch(PROMPTS, **kw)
        assert {r.stats["cache_source"] for r in warm} == {"ram"}
        for run in (cold, warm):
            assert [r.tokens for r in run] == [r.tokens for r in off]
            assert [r.parsed for r in run] == [r.parsed for r in off]
        assert eng.flush(timeout=60)["pending"] == 0
    script = (f"import json\n"
              f"from mlxcache_kernel.engine import Engine\n"
              f"with Engine(cache_dir={str(tmp_path / 'c')!r}, prefetch_budget_bytes=0) as eng:\n"
              f"    eng.load_model({str(models[arch])!r}, name='m')\n"
              f"    kw = {dict(max_tokens=200, **MODES[mode])!r}\n"
              f"    rows = eng.generate_batch({PROMPTS!r}, response_format=[{SCHEMA!r}, {SCHEMA!r}, None, None],"
              f" regex={MIXED['regex']!r}, **kw)\n"
              f"    print(json.dumps([[r.tokens, r.stats['cache_source']] for r in rows]))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    # (row 1 asks for SCHEMA's dict in place of Item: the same grammar, the same tokens)
    assert [t for t, _ in rows] == [r.tokens for r in off] and {s for _, s in rows} == {"ssd"}


def test_one_value_for_every_row_and_a_list_of_choices_per_row(models, tmp_path):
    with Engine(cache_dir=tmp_path / "c", ssd=False) as eng:
        eng.load_model(models["llama"], name="m")
        rows = eng.generate_batch(PROMPTS, max_tokens=60, choices=["yes", "no"], use_cache=False)
        assert all(r.parsed in ("yes", "no") and r.text == r.parsed for r in rows)
        per_row = [["a", "b"], None, ["x", "yy", "zzz"], ["only"]]
        rows = eng.generate_batch(PROMPTS, max_tokens=60, choices=per_row, use_cache=False)
        assert rows[0].parsed in ("a", "b") and rows[1].parsed is None and rows[3].parsed == "only"
        assert rows[2].parsed in ("x", "yy", "zzz")
        with pytest.raises(ConstraintError, match=r"response_format: a list needs one value per prompt \(4\), got 2"):
            eng.generate_batch(PROMPTS, response_format=[SCHEMA, SCHEMA])
        with pytest.raises(ConstraintError, match="prompt 1: one constraint at a time: got regex and choices"):
            eng.generate_batch(PROMPTS, regex=[None, "[0-9]", None, None], choices=[None, ["a"], None, None])
        with pytest.raises(ConstraintError, match="prompt 2: cannot compile the regex"):
            eng.generate_batch(PROMPTS, regex=[None, None, "a(b", None])
        assert eng.admin.entries() == []  # refused before any work


@pytest.mark.parametrize("mode", sorted(MODES))
def test_rows_with_drafts_from_their_context_answer_as_without(models, tmp_path, mode):
    with Engine(cache_dir=tmp_path / "c", ssd=False) as eng:
        eng.load_model(models["llama"], name="m")
        kw = dict(max_tokens=200, use_cache=False, **MIXED, **MODES[mode])
        plain = eng.generate_batch(PROMPTS, lookup=False, **kw)
        looked = eng.generate_batch(PROMPTS, lookup=True, **kw)
        assert [r.tokens for r in looked] == [r.tokens for r in plain]
        assert sum(r.stats["lookup_drafts_proposed"] for r in looked) > 0
        check_rows(looked)


def test_a_grammar_allowing_every_token_gives_the_plain_batch(tmp_path):
    path = build_tiny_model(tmp_path / "m")
    with Engine(cache_dir=tmp_path / "c", ssd=False) as eng:
        eng.load_model(path, name="m")
        free = eng.generate_batch(PROMPTS, max_tokens=30, use_cache=False, lookup=False)
        every = "start: <[0-258]>*"  # (special tokens too: the plain rows hold some)
        constrained = eng.generate_batch(PROMPTS, max_tokens=30, use_cache=False, lookup=False, grammar=every)
        assert [r.tokens for r in constrained] == [r.tokens for r in free]


def test_a_vision_language_models_answer_parses(tmp_path):
    pytest.importorskip("mlx_vlm")
    from tiny_vlm import build_vlm, make_image

    picture = tmp_path / "p.png"
    make_image(1, (112, 84)).save(picture)
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(build_vlm("qwen2_vl", tmp_path / "vlm"))
        free = eng.generate("What is in the picture?", images=[str(picture)], max_tokens=30, use_cache=False)
        r = eng.generate("What is in the picture?", images=[str(picture)], max_tokens=200, response_format=Item)
        again = eng.generate("What is in the picture?", images=[str(picture)], max_tokens=200, response_format=Item)
        assert isinstance(r.parsed, Item) and again.parsed == r.parsed and again.tokens == r.tokens
        assert again.stats["cache_source"] == "ram" and free.parsed is None
        anything = eng.generate("What is in the picture?", images=[str(picture)], max_tokens=30, use_cache=False,
                                grammar=f"start: <[{min(free.tokens)}-{max(free.tokens)}]>*")
        assert anything.tokens == free.tokens
