"""``%%generate --logprobs K`` and ``%%score`` (issue 29) in an in-process IPython shell on the
tiny model, and through a real kernel process."""

from __future__ import annotations

import math
import re

from IPython.lib.pretty import pretty
from magics_shell import engine, run, usage_error


DOC = "The keeper climbed the stairs of the lighthouse every evening at dusk. " * 5


def test_generate_shows_each_tokens_logprob_and_alternatives(ip, capsys):
    res, out, err = run(ip, capsys, f"%%generate --max-tokens 6 --logprobs 3 --out g\n{DOC}He carried a")
    assert res.success, err
    cell = ip.user_ns["g"]
    want = engine(ip).generate_tokens(engine(ip).encode_prompt(f"{DOC}He carried a"),
                                      max_tokens=6, logprobs=3, use_cache=False)
    assert cell.tokens == want.tokens and len(cell.logprobs) == 6
    assert max(abs(a.logprob - b.logprob) for a, b in zip(cell.logprobs, want.logprobs)) <= 1e-4
    text = pretty(cell)
    html = cell._repr_html_()
    assert html.count("class='mlxc-token'") == 6 and "data-logprob=" in html
    for lp in cell.logprobs:
        assert f"data-logprob='{lp.logprob:.4f}'" in html
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.logprob
    assert text.splitlines()[0].split() == ["token", "logprob", "p", "alternatives"] and len(text.splitlines()) >= 7
    # without the flag there is no table and no log-probabilities
    run(ip, capsys, f"%%generate --max-tokens 3 --out g2\n{DOC}")
    assert ip.user_ns["g2"].logprobs is None and "mlxc-token" not in ip.user_ns["g2"]._repr_html_()


def test_logprob_options_that_cannot_work_are_one_line_errors(ip, capsys):
    assert "0 to 20" in usage_error(ip, capsys, "%%generate --logprobs 21\nhi")
    assert "invalid int value: 'many'" in usage_error(ip, capsys, "%%generate --logprobs many\nhi")
    assert "--checkpoint-every" in usage_error(ip, capsys, "%%generate --logprobs 2 --checkpoint-every 4\nhi")


def test_batch_rows_carry_their_logprobs(ip, capsys):
    ip.user_ns["qs"] = ["Who?", "When?"]
    res, _, err = run(ip, capsys, f"%%generate --max-tokens 5 --logprobs 2 --batch qs\n{DOC}{{item}}")
    assert res.success, err
    df = res.result
    for total, r in zip(df["logprob"], df.attrs["results"]):
        assert len(r.logprobs) == 5 and all(len(x.top) == 2 for x in r.logprobs)
        assert abs(total - sum(x.logprob for x in r.logprobs)) < 1e-3
    assert "logprob" not in run(ip, capsys, f"%%generate --max-tokens 2 --batch qs\n{{item}}")[0].result


def test_score_ranks_options_by_log_likelihood(ip, capsys):
    ip.user_ns["opts"] = [" lamp", " lantern full of oil", " book"]
    res, out, err = run(ip, capsys, f"%%score opts --out ranked\n{DOC}He carried a")
    assert res.success, err
    ranked = ip.user_ns["ranked"]
    direct = {r.continuation: r.logprob for r in engine(ip).score(f"{DOC}He carried a", ip.user_ns["opts"],
                                                                     use_cache=False)}
    assert [r.continuation for r in ranked] == sorted(direct, key=lambda o: -direct[o])
    assert all(abs(r.logprob - direct[r.continuation]) <= 1e-6 * abs(direct[r.continuation]) + 1e-4 for r in ranked)
    assert all(math.isclose(r.mean_logprob, r.logprob / len(r.tokens)) for r in ranked)
    assert "3 options over" in out and "prefilled once" in out
    _, out, _ = run(ip, capsys, f"%%score opts\n{DOC}He carried a")
    assert re.search(r"over (\d+) context tokens: \d+ from RAM, 0 prefilled once · \d+ ms", out), out  # reused
    rows = [ln.split() for ln in out.splitlines()[2:5]]
    assert all(r[-1] in ("yes", "no") for r in rows), out  # greedy says yes or no, never blank
    ip.user_ns["thing"] = "lamp"
    _, out, _ = run(ip, capsys, f"%%score opts\n{{thing}}: a word about it")
    assert "3 options" in out  # {name} interpolation in the context


def test_score_errors_are_one_line(ip, capsys):
    ip.user_ns.update(opts=["a"], empty=[], words="a b", mixed=["a", 3])
    assert "'nope' is not defined" in usage_error(ip, capsys, "%%score nope\ncontext")
    assert "non-empty list of strings" in usage_error(ip, capsys, "%%score empty\ncontext")
    assert "non-empty list of strings" in usage_error(ip, capsys, "%%score words\ncontext")
    assert "non-empty list of strings" in usage_error(ip, capsys, "%%score mixed\ncontext")
    assert "empty context" in usage_error(ip, capsys, "%%score opts\n   ")
    assert "--system applies with --chat" in usage_error(ip, capsys, "%%score opts --system hi\ncontext")
    assert "--out needs a variable name" in usage_error(ip, capsys, "%%score opts --out 1x\ncontext")
    assert "unrecognized arguments" in usage_error(ip, capsys, "%%score opts --temperature 2\ncontext")


def test_logprobs_and_score_through_the_kernel(start_kernel):
    kernel = start_kernel()
    res = kernel.execute(f"doc = {DOC!r}\nopts = [' lamp', ' book']")
    assert res["status"] == "ok", res
    res = kernel.execute("%%generate --max-tokens 4 --logprobs 2 --out g\n{doc}He carried a")
    assert res["status"] == "ok" and "alternatives" in res["text"], res
    res = kernel.execute("%%score opts --out r\n{doc}He carried a")
    assert res["status"] == "ok" and "2 options over" in res["stream"], res
    res = kernel.execute("print(len(g.logprobs), [len(x.top) for x in g.logprobs], sorted(x.continuation for x in r),"
                         " r[0].logprob >= r[1].logprob)")
    assert res["stream"].strip() == "4 [2, 2, 2, 2] [' book', ' lamp'] True", res
