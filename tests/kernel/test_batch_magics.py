"""``%%generate --batch VAR`` / ``--n K`` and ``%model load --adapter`` in an in-process IPython
shell on the tiny model; the same through a real kernel process."""

from __future__ import annotations

import pytest
from kernel_client import Kernel
from magics_shell import engine, run, usage_error
from tiny_adapter import build_adapter

from mlxcache_kernel.magics.batch import BatchTable, template_rows

GEN = "%%generate --max-tokens 6"
DOC = "A long report about lighthouses, their keepers and the sea. " * 6


def test_templates_fill_fields_per_item():
    ns = {"doc": "D", "np": __import__("numpy")}
    assert template_rows("{doc}: {item}", "qs", ["a", "b"], ns) == ([0, 1], ["D: a", "D: b"])
    assert template_rows("{q} {{item}}", "rows", [{"q": 1}, {"q": 2}], ns) == ([0, 1], ["1 {item}", "2 {item}"])
    assert template_rows("{item}", "d", {"x": "u", "y": "v"}, ns) == (["x", "y"], ["u", "v"])


@pytest.mark.parametrize("value, fields", [(["a"], "{item}"), ([{"q": 1}], "{q}")])
def test_a_bad_template_field_is_an_error_naming_it(value, fields):
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match=r"template field \{qestion\} is neither a field of qs \(" + fields):
        template_rows("{qestion}", "qs", value, {})
    with pytest.raises(UsageError, match="qs: it has no items"):
        template_rows("{item}", "qs", [], {})
    with pytest.raises(UsageError, match="needs a list"):
        template_rows("{item}", "qs", "a string", {})


def test_missing_values_are_named(capsys):
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"q": ["Who?", None, float("nan")], "tone": ["a", "b", "c"]}, index=["x", "y", "z"])
    assert template_rows("{q} {tone}", "df", df, {})[1] == ["Who? a", "nan b", "nan c"]
    assert "df has no value for {q} in 2 item(s) ('y', 'z')" in capsys.readouterr().err
    template_rows("{tone}", "df", df, {})  # an unused column may miss values
    assert "no value" not in capsys.readouterr().err


def test_batch_over_a_list(ip, capsys):
    ip.user_ns.update(doc=DOC, qs=["Who built it?", "When was it lit?", "Why red?"])
    res, out, err = run(ip, capsys, f"{GEN} --batch qs --out answers\nRead: {{doc}}\nQuestion: {{item}}")
    assert res.success, err
    df = res.result
    assert list(df["prompt"]) == [f"Read: {DOC}\nQuestion: {q}" for q in ip.user_ns["qs"]]
    assert ip.user_ns["answers"] is df and list(df.index) == [0, 1, 2]
    results = df.attrs["results"]
    assert list(df["text"]) == [r.text for r in results] and all(len(r.tokens) == 6 for r in results)
    assert (df["shared"] > 0).all() and (df["ram"] == 0).all() and "prefilled once" in out and "batched" in out
    again = run(ip, capsys, f"{GEN} --batch qs\nRead: {{doc}}\nQuestion: {{item}}")[0].result
    assert list(again["text"]) == list(df["text"]) and (again["prefilled"] == 1).all()
    assert (again["ram"] == again["prompt"].map(lambda p: len(engine(ip).encode_prompt(p)) - 1)).all()


def test_batch_table_shows_speeds_as_the_footer_does(ip, capsys):
    """ttft in ms and tok/s, one decimal (not 1.043469 s): numbers still, exact ones in the results."""
    pd = pytest.importorskip("pandas")
    ip.user_ns.update(qs=["Who built it?", "When was it lit?"])
    df = run(ip, capsys, f"{GEN} --batch qs\n{DOC} {{item}}")[0].result
    assert "ttft_s" not in df.columns and {"ttft_ms", "tok_s"} <= set(df.columns)
    for row, r in zip(df.itertuples(), df.attrs["results"]):
        assert row.ttft_ms == round(r.stats["ttft_s"] * 1000, 1)
        assert row.tok_s == round(r.stats["decode_tokens_per_s"], 1)
    shown = df[["ttft_ms", "tok_s"]].to_string()
    assert all(len(cell.split(".")[-1]) == 1 for cell in shown.split() if cell.replace(".", "").isdigit()
               and "." in cell), shown
    assert pd.api.types.is_float_dtype(df["ttft_ms"])


def test_batch_over_a_dataframe_column_and_samples(ip, capsys):
    pd = pytest.importorskip("pandas")
    ip.user_ns["df"] = pd.DataFrame({"question": ["Who?", "What?"], "tone": ["short", "long"]},
                                    index=pd.Index(["a", "b"], name="id"))
    df = run(ip, capsys, f"{GEN} --batch df\n{{question}} Answer in a {{tone}} way.")[0].result
    assert list(df.index) == ["a", "b"] and df.index.name == "id"
    assert list(df["prompt"]) == ["Who? Answer in a short way.", "What? Answer in a long way."]
    ip.user_ns["doc"] = DOC
    res, out, err = run(ip, capsys, f"{GEN} --n 4 --temperature 0.9 --seed 3\nTell me about {{doc}}")
    samples = res.result
    assert list(samples.index) == [0, 1, 2, 3] and list(samples["seed"]) == [3, 4, 5, 6]
    assert samples["text"].nunique() > 1 and (samples["prefilled"] == 1).all()
    results = samples.attrs["results"]
    assert all(r.stats["batch_shared_tokens"] + r.stats["cached_tokens"] == r.stats["prompt_tokens"] - 1
               and r.stats["batch_shared_tokens"] > 0 for r in results)  # one prefill for the four samples
    both = run(ip, capsys, f"{GEN} --batch df --n 2 -t 0.8\n{{question}}")[0].result
    assert list(both.index) == [("a", 0), ("a", 1), ("b", 0), ("b", 1)] and list(both["seed"]) == [0, 1, 0, 1]
    _, _, err = run(ip, capsys, f"{GEN} --n 2\nsame twice")
    assert "gives 2 identical texts" in err


def test_batch_table_keeps_the_questions_and_shows_answers_whole(ip, capsys):
    pd = pytest.importorskip("pandas")
    ip.user_ns["quiz"] = pd.DataFrame({"question": ["Who lit it?", "Why red?"], "level": [1, 2]})
    df = run(ip, capsys, "%%generate --max-tokens 60 --batch quiz\n" + DOC + "{question}")[0].result
    assert list(df.columns[:3]) == ["question", "level", "text"] and df.columns[-1] == "prompt"
    assert list(df["question"]) == ["Who lit it?", "Why red?"] and isinstance(df, pd.DataFrame)
    html = df._repr_html_()
    assert "white-space:pre-wrap" in html and "Who lit it?" in html and DOC[:40] not in html  # no prompt column
    shown = __import__("html").unescape(html)
    assert all(r.text in shown for r in df.attrs["results"])  # whole (not cut at 50), line breaks as they are
    assert type(df[["text"]]) is pd.DataFrame  # what is derived from it is a plain DataFrame


def test_batch_errors_are_one_line(ip, capsys):
    ip.user_ns["qs"] = ["a", "b"]
    assert "template field {qestion}" in usage_error(ip, capsys, f"{GEN} --batch qs\n{{qestion}}")
    assert "--batch needs the name of a defined variable" in usage_error(ip, capsys, f"{GEN} --batch nothing\n{{item}}")
    assert "neither --session" in usage_error(ip, capsys, f"{GEN} --batch qs --session s\n{{item}}")
    assert "cannot be --literal" in usage_error(ip, capsys, f"{GEN} --batch qs --literal\n{{item}}")
    assert "--n must be >= 1" in usage_error(ip, capsys, f"{GEN} --n 0\nhi")
    assert "--out needs a variable name" in usage_error(ip, capsys, f"{GEN} --batch qs --out class\n{{item}}")
    ip.user_ns["qs"] = []
    assert "it has no items" in usage_error(ip, capsys, f"{GEN} --batch qs\n{{item}}")
    ip.user_ns["df"] = pytest.importorskip("pandas").DataFrame({"question": ["a"]})
    assert "template field {questions} is neither a field of df ({question})" in \
        usage_error(ip, capsys, f"{GEN} --batch df\n{{questions}}")


def test_without_pandas_the_table_is_plain_rows(ip, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pandas(name, *a, **kw):
        if name == "pandas":
            raise ImportError("no pandas here")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_pandas)
    ip.user_ns["qs"] = ["one", "two"]
    table = run(ip, capsys, f"{GEN} --batch qs\nSay {{item}}")[0].result
    assert isinstance(table, BatchTable) and [r["index"] for r in table] == [0, 1]
    assert [r["prompt"] for r in table] == ["Say one", "Say two"] and len(table.results) == 2
    text = repr(table)
    assert text.splitlines()[0].split()[:3] == ["index", "item", "text"] and "Say two" in text  # the prompt last


def test_model_load_with_an_adapter(ip, capsys, tmp_path):
    adapter = build_adapter(ip.tiny_model_dir, tmp_path / "adapter", seed=3)
    res, out, _ = run(ip, capsys, f"%model load {ip.tiny_model_dir} --name ft --adapter {adapter}")
    assert res.success and f"+ adapter {adapter}" in out
    out = run(ip, capsys, "%model list")[1]
    assert "adapter" in out.splitlines()[0] and str(adapter) in out
    out = run(ip, capsys, "%model info ft")[1]
    assert f"adapter: {adapter}" in out and "identity.adapter" in out
    assert "only apply to %model load" in usage_error(ip, capsys, f"%model list --adapter {adapter}")
    assert "not an mlx-lm adapter directory" in usage_error(ip, capsys, f"%model load {ip.tiny_model_dir} --adapter {tmp_path}")


@pytest.fixture
def kernel(spec_prefix, tmp_path, tiny_model_dir):
    import os

    env = dict(os.environ, MLXCACHE_CACHE_DIR=str(tmp_path / "cache"), MLXCACHE_DEFAULT_MODEL=str(tiny_model_dir),
               MLXCACHE_RAM_BUDGET="256MiB", JUPYTER_PLATFORM_DIRS="1")
    k = Kernel(spec_prefix, env, tmp_path / "kernel.log")
    yield k
    k.shutdown()


def test_batch_through_the_kernel(kernel):
    res = kernel.execute("import pandas as pd\ndoc = 'The lighthouse report. ' * 8\n"
                         "qs = ['Who?', 'When?']\ndf = pd.DataFrame({'q': ['Why?', 'How?', 'Where?']})")
    assert res["status"] == "ok", res
    res = kernel.execute(f"{GEN} --batch qs --out a\n{{doc}} {{item}}")
    assert res["status"] == "ok" and "[mlxcache] 2 rows" in res["stream"], res
    assert "text" in res["results"][0] and "prompt" in res["results"][0]
    res = kernel.execute(f"{GEN} --batch df --out b\n{{doc}} {{q}}")
    assert res["status"] == "ok" and "[mlxcache] 3 rows" in res["stream"], res
    res = kernel.execute(f"{GEN} --n 4 -t 0.9 --out c\n{{doc}} Describe it.")
    assert res["status"] == "ok" and "[mlxcache] 4 rows" in res["stream"], res
    res = kernel.execute("print(len(a), len(b), list(c['seed']), int(b['ram'].sum()) > 0, "
                         "[r.stats['batch_mode'] for r in c.attrs['results']])")
    assert res["stream"].strip() == "2 3 [0, 1, 2, 3] True ['shared-prefix', 'shared-prefix', 'shared-prefix', 'shared-prefix']", res
    res = kernel.execute(f"{GEN} --batch df\n{{qq}}")
    assert res["status"] == "error" and "template field {qq}" in res["error"][1], res
