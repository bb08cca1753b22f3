"""What a notebook user notices first (issue 14), in an in-process IPython
shell on the tiny model: the footer bar, help with examples and the cheat
sheet, readable previews, a bounded ``%cache ls``, and the warning for an
undefined ``{name}``."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest
from magics_shell import GEN, engine, run, usage_error

from mlxcache_kernel.magics import CellResult, interpolate
from mlxcache_kernel.magics.help import CHEAT_SHEET, EXAMPLES

# --- 1. the footer as a bar ---


def _gen(**stats) -> CellResult:
    result = SimpleNamespace(text="hi", tokens=[1, 2], logprobs=None, stats={"ttft_s": 0.05, "decode_tokens_per_s": 12.5, **stats})
    return CellResult(result, prompt="p", model="default", session=None, use_cache=True)


def _widths(html: str) -> dict:
    return {k: float(w) for k, w in re.findall(r"mlxc-span-(\w+)' data-tokens='\d+'[^>]*width:([\d.]+)%", html)}


def test_footer_bar_splits_the_prompt_in_proportion():
    g = _gen(prompt_tokens=200, ram_tokens=100, ssd_tokens=50, prefilled_tokens=50, cached_tokens=150,
             cache_source="ram")
    html = g._repr_html_()
    assert _widths(html) == {"ram": 50.0, "ssd": 25.0, "prefilled": 25.0}
    assert "TTFT 50 ms · 12.5 tok/s" in html and "mlxc-footer-bar" in html
    # text/plain is the footer in words, as before
    assert repr(g) == g.footer() and g.footer().startswith(
        "[mlxcache] 200 prompt tokens: 100 from RAM, 50 from SSD, 50 prefilled · TTFT 50 ms")


def test_footer_bar_shows_remote_tokens():
    g = _gen(prompt_tokens=10, ram_tokens=0, ssd_tokens=0, remote_tokens=8, prefilled_tokens=2, cached_tokens=8,
             cache_source="remote")
    assert _widths(g._repr_html_()) == {"remote": 80.0, "prefilled": 20.0}
    assert "8 remote" in g._repr_html_()


def test_footer_bar_escapes_and_all_prefilled():
    g = _gen(prompt_tokens=5, ram_tokens=0, ssd_tokens=0, prefilled_tokens=5, cached_tokens=0, cache_source=None)
    g.model = "<b>m</b>"
    html = g._repr_html_()
    assert _widths(html) == {"prefilled": 100.0} and "<b>m</b>" not in html and "&lt;b&gt;" in html


def test_footer_says_why_it_stopped_how_full_the_context_is_and_what_it_cost():
    g = _gen(prompt_tokens=1600, ram_tokens=0, ssd_tokens=0, prefilled_tokens=1600, decode_tokens=72,
             finish_reason="length", context_window=8192, prefill_tokens_per_s=98.4, peak_memory_bytes=612 << 20)
    words = g.footer()
    assert "72 tokens at 12.5 tok/s · stopped at max tokens · context 1,672 of 8,192 tokens" in words, words
    assert "prefill 98 tok/s · peak memory 612.0 MiB" in words and "\n" not in words
    assert "ended (end-of-sequence token)" in _gen(prompt_tokens=5, finish_reason="eos").footer()
    assert "(past the window)" in _gen(prompt_tokens=90, decode_tokens=20, context_window=100).footer()


def test_footer_says_why_a_prefix_missed_on_a_line_of_its_own(ip, capsys):
    g = _gen(prompt_tokens=10, prefilled_tokens=10, cache_why="another system prompt: 9 tokens ...")
    assert g.footer().splitlines()[1] == "[mlxcache] why: another system prompt: 9 tokens ... (%cache why)"
    assert "mlxc-footer-why" in g._repr_html_() and "mlxc-footer-why" not in _gen(prompt_tokens=10)._repr_html_()
    run(ip, capsys, f"{GEN} --system 'You are a ship.'\n" + "The lighthouse keeper writes the weather. " * 6)
    res, out, _ = run(ip, capsys, f"{GEN} --system 'Be brief.'\n" + "The lighthouse keeper writes the weather. " * 6)
    assert "[mlxcache] why: another system prompt" in repr(res.result)
    _, out, _ = run(ip, capsys, "%cache why")
    assert out.startswith("another system prompt") and "they part at token" in out and "Be brief" in out, out


def test_generate_result_has_bar_in_html(ip, capsys):
    g = run(ip, capsys, f"{GEN}\nbar me")[0].result
    assert ip.display_formatter.formatters["text/plain"](g) == g.footer()
    assert "mlxc-span-prefilled" in g._repr_html_()  # the browser test sees it rendered


# --- 2. help and the cheat sheet ---

MAGICS = {"generate": "find_cell_magic", "model": "find_line_magic", "session": "find_line_magic",
          "checkpoint": "find_line_magic", "cache": "find_line_magic", "kv": "find_line_magic",
          "memo": "find_line_magic", "eval": "find_line_magic"}


@pytest.mark.parametrize("name", sorted(MAGICS))
def test_help_has_one_example_per_option_and_action(ip, name):
    func = getattr(ip, MAGICS[name])(name)
    doc = func.__doc__
    assert "Examples:" in doc
    example_lines = [ln.strip() for ln in doc.split("Examples:", 1)[1].splitlines() if ln.strip().startswith("%")]
    words = [set(ln.split("  ")[0].split()) for ln in example_lines]
    parser = func.parser
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and longs[0] != "--help":
            assert any(longs[0] in w for w in words), (name, longs[0])
        for choice in (action.choices or ()) if not action.option_strings else ():
            assert any(choice in w for w in words), (name, choice)
    assert example_lines and "Examples:" in ip.object_inspect_text(("%%" if name == "generate" else "%") + name)


def test_cheat_sheet(ip, capsys):
    res, out, _ = run(ip, capsys, "%mlxcache")
    assert res.success and out.strip() == CHEAT_SHEET
    assert len(out.splitlines()) <= 30 and max(map(len, out.splitlines())) <= 100
    for name in list(EXAMPLES) + ["dashboard"]:
        assert f"%{name}" in out, name
    for action in ip.find_cell_magic("generate").__self__.generate.parser._actions:  # every %%generate option
        assert action.dest == "help" or any(o in out for o in action.option_strings), action.option_strings
    res, out2, _ = run(ip, capsys, "%cache help")
    assert res.success and out2 == out
    assert "takes no arguments" in usage_error(ip, capsys, "%mlxcache now")


# --- 3. previews: the user's own text first ---


def test_previews_show_the_user_text_first(ip, capsys):
    run(ip, capsys, f"{GEN}\nWhere is the lighthouse?")
    run(ip, capsys, f"{GEN} --system 'Be brief.'\nA second question")
    previews = [e["preview"] for e in engine(ip).admin.entries()]
    assert any(p.startswith("Where is the lighthouse?") for p in previews), previews
    assert any(p.startswith("Be brief. · A second question") for p in previews), previews
    assert not [p for p in previews if p.startswith(("user", "system", "<|im_start|>"))], previews
    run(ip, capsys, "%checkpoint save q1")
    assert engine(ip).checkpoint_list()[0]["preview"].startswith("A second question") or \
        engine(ip).checkpoint_list()[0]["preview"].startswith("Be brief.")
    res, out, _ = run(ip, capsys, "%cache ls")
    assert "Where is the lighthouse?" in out and "user Where" not in out


# --- 4. %cache ls: newest first, 20 rows, --all, --model, --session ---


def _rows(n: int) -> list[dict]:
    now = time.time()
    return [{"model": "default" if i % 2 else "other", "tokens": 10 + i, "tier": "ram", "write_state": "committed",
             "ram_bytes": 1, "kv_bytes": 1, "file_bytes": None, "borrowers": 0,
             "sessions": ["chat1"] if i % 3 == 0 else [], "pinned": [], "hits": 0, "last_used": now - 60 * (n - i),
             "preview": f"entry number {i}"} for i in range(n)]


def _previews(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"entry number (\d+)", out)]


def test_cache_ls_newest_first_bounded_and_filtered(ip, capsys, monkeypatch):
    rows = _rows(30)
    monkeypatch.setattr(engine(ip).admin, "entries", lambda poll=True: list(rows))  # oldest first on purpose
    res, out, _ = run(ip, capsys, "%cache ls")
    assert res.success and _previews(out) == list(range(29, 9, -1))
    assert "... and 10 older entries (%cache ls --all lists every one)" in out
    out = run(ip, capsys, "%cache ls --all")[1]
    assert _previews(out) == list(range(29, -1, -1)) and "older entries" not in out
    out = run(ip, capsys, "%cache ls --model other --all")[1]
    assert _previews(out) == [i for i in range(29, -1, -1) if i % 2 == 0]
    out = run(ip, capsys, "%cache ls --session chat1")[1]
    assert _previews(out) == [i for i in range(29, -1, -1) if i % 3 == 0]
    out = run(ip, capsys, "%cache ls --session nobody")[1]
    assert out.strip() == "no entries of session 'nobody'"
    assert "only apply to %cache ls" in usage_error(ip, capsys, "%cache stats --model m")
    assert "only applies to %cache ls and %cache stats" in usage_error(ip, capsys, "%cache flush --all")


# --- 5. an undefined {name} ---


def test_interpolate_reports_undefined_names():
    undefined: list = []
    text = interpolate("{doc} {nope} {{lit}} {_p} {nope}", {"doc": "D"}, set(), undefined)
    assert text == "D {nope} {lit} {_p} {nope}" and undefined == ["nope", "_p"]


def test_generate_warns_once_about_an_undefined_name(ip, capsys):
    ip.user_ns["doc"] = "the doc"
    res, out, err = run(ip, capsys, f"{GEN}\nSummarize {{doc}} and {{nothing_here}}")
    assert res.success and res.result.prompt == "Summarize the doc and {nothing_here}"
    warnings = [ln for ln in err.splitlines() if "warning" in ln]
    assert warnings == ["[mlxcache] warning: {nothing_here} is not defined and sent as written; define the "
                        "variable, or write {{nothing_here}} for a literal {nothing_here} (--literal: no "
                        "interpolation)"], err
    res, out, err = run(ip, capsys, f"{GEN}\nA literal {{{{nothing_here}}}} and {{doc}}")
    assert res.success and res.result.prompt == "A literal {nothing_here} and the doc" and "warning" not in err
    res, out, err = run(ip, capsys, f"{GEN} --literal\nno {{nothing_here}} warning")
    assert res.success and "warning" not in err


@pytest.mark.smollm
def test_smollm2_previews_skip_the_default_system_prompt(default_model_dir, tmp_path):
    from mlxcache_kernel.engine import Engine

    with Engine(cache_dir=str(tmp_path / "cache"), ram_budget_bytes=256 << 20) as eng:
        eng.load_model(str(default_model_dir))
        eng.generate("What is a lighthouse?", max_tokens=4)
        eng.generate("Hello there", max_tokens=4, system="Be brief.")
        eng.generate("Q one", max_tokens=4, session="s1")
        previews = sorted(e["preview"] for e in eng.admin.entries())
    assert [p.split(" · ")[0] for p in previews] == ["Be brief.", "Q one", "What is a lighthouse?"], previews
    assert previews[0].startswith("Be brief. · Hello there · ")
    assert not any("SmolLM" in p or "system" in p or "<|im" in p for p in previews), previews
