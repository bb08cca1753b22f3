"""``%%generate --passages VAR`` (and ``--recompute F``) in the in-process shell on the tiny model: a list or a
DataFrame column before the cell's prompt, the footer that says how much was reused and recomputed and that
the result is approximate, the bar's span of passage tokens, and one UsageError line for what cannot go."""

from __future__ import annotations

import re

import pytest
from magics_shell import GEN, engine, run, usage_error

DOCS = ["Ships came in from the west before the storm, forty of them.",
        "Snow stays on the mountains north of the river until June.",
        "The lighthouse keeper wrote down the wind every night."]


@pytest.fixture
def docs(ip):
    ip.user_ns["docs"] = list(DOCS)
    yield DOCS
    ip.user_ns.pop("docs", None)
    ip.user_ns.pop("frame", None)


def test_passages_from_a_list_then_reused_in_another_order(ip, capsys, docs):
    first = run(ip, capsys, f"{GEN} --system 'Answer briefly.' --passages docs\nWhich ships?")[0].result
    assert first.stats["passages"] == 3 and first.stats["passage_sources"] == ["encoded"] * 3
    ip.user_ns["docs"] = DOCS[::-1]
    g = run(ip, capsys, f"{GEN} --system 'Answer briefly.' --passages docs --recompute 0.3 -o g\nWhich ships?")[0].result
    assert ip.user_ns["g"] is g and g.stats["passage_recompute"] == 0.3
    words = g.footer()
    assert re.search(r"passages reused: 3 of 3, \d+% recomputed \(approximate\)", words), words
    assert f"{g.stats['passage_tokens_placed']} from passages" in words
    assert f"mlxc-span-passages' data-tokens='{g.stats['passage_tokens_placed']}'" in g._repr_html_()
    plain = engine(ip).generate("\n\n".join(DOCS[::-1]) + "\n\nWhich ships?", system="Answer briefly.",
                                max_tokens=8, use_cache=False)
    assert g.result.prompt_tokens == plain.prompt_tokens  # the prompt a full prefill would see


def test_passages_from_a_dataframe_column(ip, capsys, docs):
    pd = pytest.importorskip("pandas")
    ip.user_ns["frame"] = pd.DataFrame({"text": DOCS, "n": [1, 2, 3]})
    g = run(ip, capsys, f"{GEN} --passages frame.text --recompute 1\nWhich ships?")[0].result
    assert g.stats["passages"] == 3 and g.stats["approximate"] is False
    assert "100% recomputed (exact)" in g.footer()
    assert "DataFrame with 2 columns" in usage_error(ip, capsys, f"{GEN} --passages frame\nWhich ships?")


def test_what_cannot_go_with_passages_is_one_line(ip, capsys, docs):
    assert "'nothing' is not defined" in usage_error(ip, capsys, f"{GEN} --passages nothing\nQ?")
    assert "has no 'missing'" in usage_error(ip, capsys, f"{GEN} --passages docs.missing\nQ?")
    assert "--recompute goes with --passages" in usage_error(ip, capsys, f"{GEN} --recompute 0.5\nQ?")
    assert "from 0 to 1" in usage_error(ip, capsys, f"{GEN} --passages docs --recompute 2\nQ?")
    assert "does not go with --batch" in usage_error(ip, capsys, f"{GEN} --passages docs --n 2\nQ?")
    assert "do not go with a session" in usage_error(ip, capsys, f"{GEN} --passages docs --session s\nQ?")
    ip.user_ns["docs"] = "one string"
    assert "not one string" in usage_error(ip, capsys, f"{GEN} --passages docs\nQ?")
