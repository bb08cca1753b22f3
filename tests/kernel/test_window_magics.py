"""Bad input in a cell is one line, never a traceback (issue 49): a prompt past the model's
window (and --truncate to go on knowingly), a {var} too long for any prompt (refused before it
is tokenized), a {var} whose str() raises, a lone surrogate character."""

from __future__ import annotations

from magics_shell import GEN, engine, run, usage_error

from mlxcache_kernel.engine.generate.window import MAX_CHARS_PER_TOKEN

WINDOW = 4096  # the tiny model's (tests/support/tiny_model.py); a character of ASCII is a token


class Broken:
    def __str__(self):
        raise RuntimeError("no text for you\nsecond line")


def test_a_var_whose_str_raises_names_the_variable_and_the_exception(ip, capsys):
    ip.user_ns["doc"] = Broken()
    msg = usage_error(ip, capsys, f"{GEN}\nSummarize {{doc}}")
    assert msg == "{doc}: str(doc) raised RuntimeError: no text for you"
    ip.user_ns["opts"] = [" a", " b"]
    assert usage_error(ip, capsys, "%%score opts\nabout {doc}").startswith("{doc}: str(doc) raised RuntimeError")


def test_a_lone_surrogate_in_a_cell_is_one_line(ip, capsys):
    msg = usage_error(ip, capsys, f"{GEN}\nab\ud800c")
    assert "U+D800" in msg and "position 2" in msg


def test_a_var_too_long_for_any_prompt_is_refused_before_it_is_tokenized(ip, capsys):
    ip.user_ns["doc"] = "x" * 10_000_000
    msg = usage_error(ip, capsys, f"{GEN}\nSummarize {{doc}}")
    assert msg.startswith("{doc} is 10,000,000 characters") and f"{WINDOW * MAX_CHARS_PER_TOKEN:,}" in msg
    assert "--truncate" in msg and engine(ip).stats()["engine_prefilled_tokens"] == 0


def test_a_prompt_past_the_window_is_refused_then_truncated_knowingly(ip, capsys):
    ip.user_ns["doc"] = "y" * 5000
    msg = usage_error(ip, capsys, f"{GEN} --raw\n{{doc}}")
    assert "5,000 tokens + max_tokens 8 does not fit" in msg and f"({WINDOW:,} tokens)" in msg
    assert engine(ip).stats()["engine_prefilled_tokens"] == 0
    res, out, err = run(ip, capsys, f"{GEN} --raw --truncate left --out g\n{{doc}}")
    assert res.success, err
    g = ip.user_ns["g"]
    assert g.stats["truncated_tokens"] == 5000 - (WINDOW - 8) and g.stats["prompt_tokens"] == WINDOW - 8
    assert f"{5000 - (WINDOW - 8)} prompt tokens dropped to fit the model's window" in g.footer()
    ip.user_ns["doc"] = "z" * 10_000_000  # with --truncate, a {var} too long is cut too (then the prompt)
    res, out, err = run(ip, capsys, f"{GEN} --raw --truncate middle --out g\n{{doc}}")
    assert res.success, err
    assert ip.user_ns["g"].stats["prompt_tokens"] == WINDOW - 8


def test_batch_rows_and_score_contexts_take_truncate(ip, capsys):
    ip.user_ns["items"] = ["short", "w" * 5000]
    msg = usage_error(ip, capsys, f"{GEN} --raw --batch items\n{{item}}")
    assert msg.startswith("prompt 1: prompt of 5,000 tokens")
    res, out, err = run(ip, capsys, f"{GEN} --raw --batch items --truncate left --out t\n{{item}}")
    assert res.success, err
    assert [r.stats["truncated_tokens"] for r in ip.user_ns["t"].attrs["results"]] == [0, 5000 - (WINDOW - 8)]
    ip.user_ns["opts"] = [" yes", " no"]
    ip.user_ns["doc"] = "v" * 5000
    assert "past the model's context window of 4096" in usage_error(ip, capsys, "%%score opts\n{doc}")
    res, out, err = run(ip, capsys, "%%score opts --truncate left --out ranked\n{doc}")
    assert res.success, err
    ranked = ip.user_ns["ranked"]
    assert ranked[0].stats["context_tokens"] == WINDOW + 1 - max(len(r.tokens) for r in ranked)
