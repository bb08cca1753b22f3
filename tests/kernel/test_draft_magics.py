"""``%%generate --draft NAME --draft-tokens K`` in the in-process IPython shell on the tiny model:
the same text as without a draft, the draft's counts in the footer and ``.stats``; bad drafts are
one-line errors."""

from __future__ import annotations

from magics_shell import run, usage_error

GEN = "%%generate --max-tokens 12"


def test_a_draft_gives_the_same_text_and_its_counts_in_the_footer(ip, capsys):
    assert run(ip, capsys, f"{GEN} --no-cache\nTell me about ships.")[0].success  # loads the default model
    res, _, err = run(ip, capsys, f"%model load {ip.tiny_model_dir} --name twin")
    assert res.success, err
    for flags in ("--draft twin", "--draft twin --draft-tokens 2", "--draft default --draft-tokens 6 --seed 3"):
        seeded = "--seed" in flags
        expected = run(ip, capsys, f"{GEN} --no-cache {'-t 0.7 --seed 3' if seeded else ''}\nTell me about ships.")[0]
        res, out, err = run(ip, capsys, f"{GEN} {flags} {'-t 0.7' if seeded else ''} --out r\nTell me about ships.")
        assert res.success, err
        r = ip.user_ns["r"]
        assert r.tokens == expected.result.tokens and r.text == expected.result.text
        k = int(flags.split("--draft-tokens ")[1].split()[0]) if "--draft-tokens" in flags else 4
        assert r.stats["num_draft_tokens"] == k and r.stats["draft_tokens_proposed"] > 0
        accepted, proposed = r.stats["draft_tokens_accepted"], r.stats["draft_tokens_proposed"]
        assert accepted == proposed  # the target's own weights propose what it samples
        assert f"of {proposed} proposed tokens accepted (100%)" in r.footer() and "draft " in r.footer()
        assert "proposed tokens accepted" in r._repr_html_()


def test_bad_draft_options_are_one_line_errors(ip, capsys):
    run(ip, capsys, f"{GEN}\nwarm up")  # loads the default model
    ip.user_ns["qs"] = ["a", "b"]
    assert "--draft does not go with --batch" in usage_error(ip, capsys, f"{GEN} --draft default --batch qs\n{{item}}")
    assert "--draft does not go with --batch or --n" in usage_error(ip, capsys, f"{GEN} --draft default --n 2\nhi")
    assert "--draft-tokens needs --draft" in usage_error(ip, capsys, f"{GEN} --draft-tokens 3\nhi")
    assert "unknown draft model 'nope'" in usage_error(ip, capsys, f"{GEN} --draft nope\nhi")
    assert "num_draft_tokens must be an integer from 1 to 32" in usage_error(
        ip, capsys, f"{GEN} --draft default --draft-tokens 0\nhi")


def test_a_default_draft_from_model_load_and_no_draft(ip, capsys):
    res, _, err = run(ip, capsys, f"%model load {ip.tiny_model_dir} --name twin")
    assert res.success, err
    res, _, err = run(ip, capsys, f"%model load {ip.tiny_model_dir} --name big --draft twin")
    assert res.success, err
    expected = run(ip, capsys, f"{GEN} --model big --no-draft --no-cache --out p\nTell me about ships.")[0]
    assert "draft" not in ip.user_ns["p"].stats
    res, _, err = run(ip, capsys, f"{GEN} --model big --draft-tokens 2 --out r\nTell me about ships.")
    assert res.success, err
    r = ip.user_ns["r"]
    assert r.tokens == expected.result.tokens and r.stats["draft"] == "twin" and r.stats["num_draft_tokens"] == 2
    assert "proposed tokens accepted (100%)" in r.footer()
    assert "--draft and --no-draft contradict" in usage_error(ip, capsys, f"{GEN} --draft twin --no-draft\nhi")
    assert "only apply to %model load" in usage_error(ip, capsys, "%model info big --draft twin")
    assert "unknown draft model 'nope'" in usage_error(ip, capsys, f"%model load {ip.tiny_model_dir} --draft nope")


def test_lookup_and_no_lookup(ip, capsys):
    from mlxcache_kernel.magics.footer import lookup_phrase

    expected = run(ip, capsys, f"{GEN} --no-cache --no-lookup --out p\nTell me about ships. Ships, ships.")[0]
    assert expected.success and ip.user_ns["p"].stats["lookup_drafts"] is False
    res, _, err = run(ip, capsys, f"{GEN} --no-cache --lookup --out r\nTell me about ships. Ships, ships.")
    assert res.success, err
    r = ip.user_ns["r"]
    assert r.tokens == expected.result.tokens and r.stats["lookup_drafts"] is True
    ip.user_ns["qs"] = ["a b a b", "c d c d"]
    res, _, err = run(ip, capsys, f"{GEN} --lookup --batch qs\n{{item}}")
    assert res.success, err
    assert "--lookup and --no-lookup contradict" in usage_error(ip, capsys, f"{GEN} --lookup --no-lookup\nhi")
    stats = {"lookup_drafts": True, "lookup_drafts_proposed": 48, "lookup_drafts_accepted": 40,
             "lookup_drafts_acceptance": 0.8333, "lookup_drafts_speedup": 2.1}
    assert lookup_phrase(stats) == "lookup: 40 of 48 drafted tokens accepted (83%), 2.10x"
    assert lookup_phrase({"lookup_drafts": True, "lookup_drafts_proposed": 0}) is None
    assert lookup_phrase({"lookup_drafts_fallback": "model 'm' converts its KV ...: decoding without"}) == \
        "lookup not used (model 'm' converts its KV ...)"
