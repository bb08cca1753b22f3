"""Previews tell entries apart (issue 50): questions over one document read as their questions in
`eng.admin.entries()` (%cache ls, the dashboard) and in the process report (the panel)."""

from __future__ import annotations

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.admin.reports import ProcessReport
from mlxcache_kernel.engine.kv.tokens import parting_points

DOC = ("Heap queue algorithm (a.k.a. priority queue). Heaps are arrays for which a[k] <= a[2*k+1] and "
       "a[k] <= a[2*k+2] for all k, counting elements from zero. ") * 3
QUESTIONS = ["How do I push?", "What does heappop return?", "Is it a min-heap?", "Why zero-based?"]


def test_questions_over_one_document_read_as_their_questions(tiny_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(tiny_model_dir, name="m")
        for q in QUESTIONS:
            eng.generate(DOC + "\n\nQuestion: " + q, max_tokens=2, raw=True)
        eng.generate("A short note.", max_tokens=2, raw=True)
        previews = {e["preview"] for e in eng.admin.entries()}
        assert len(previews) == len(QUESTIONS) + 1, previews
        for q in QUESTIONS:  # each shows its start, then what it says after the shared document
            assert any(p.startswith("Heap queue") and " … " in p and q[:12] in p for p in previews), (q, previews)
        assert "A short note." in {p.split(" · ")[0] for p in previews}  # alone: its start, as before
        reported = {e["preview"] for e in ProcessReport(eng).build()["entries"]}
        assert reported == previews


def test_parting_points_are_the_longest_shared_start():
    seqs = [(1, 2, 3, 4), (1, 2, 3, 9), (1, 2, 7), (5,)]
    assert parting_points(seqs) == [3, 3, 2, 0]


def test_what_entries_hold_in_ram_adds_up(tiny_model_dir, tmp_path):
    """Each entry's own bytes, plus the document two questions share counted once, are what RAM holds
    (%cache ls: ram and shared columns; ram_bytes alone counts the document in both rows)."""
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(tiny_model_dir, name="m")
        for q in QUESTIONS[:2]:
            eng.generate(DOC + "\n\nQuestion: " + q, max_tokens=2, raw=True)
        rows = [e for e in eng.admin.entries() if e["ram_bytes"]]
        used = eng.stats()["ram_used_bytes"]
        assert len(rows) == 2 and sum(r["ram_bytes"] for r in rows) > used  # the document twice
        a, b = sorted(rows, key=lambda r: r["ram_own_bytes"])
        assert a["ram_own_bytes"] < a["ram_bytes"] and b["ram_own_bytes"] + a["ram_bytes"] == used
