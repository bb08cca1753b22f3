"""``%%generate --json / --regex / --choice / --grammar`` in the in-process IPython shell on the tiny
model: the answer parses (``.parsed``), the footer says whether it is complete, ``--batch df --json
Model`` gives one column per field beside each row's provenance, and bad options are one line."""

from __future__ import annotations

import re

from magics_shell import engine, run, usage_error
from pydantic import BaseModel, ConfigDict, Field

GEN = "%%generate --max-tokens 200 --out r"
COMPACT = {"x-guidance": {"whitespace_flexible": False}}


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=COMPACT)
    name: str = Field(max_length=5)
    legs: int = Field(ge=0, le=8)


def test_each_option_gives_a_parsed_answer_and_says_so_in_the_footer(ip, capsys):
    ip.user_ns.update(Pet=Pet, schema=Pet.model_json_schema(), labels=["cat", "dog"],
                      lark='start: "(" /[0-9]{1,2}/ ")"')
    for option, check in (("--json Pet", lambda r: isinstance(r.parsed, Pet)),
                          ("--json schema", lambda r: Pet.model_validate(r.parsed) is not None),
                          ("--regex '[a-z]{2}-[0-9]{3}'", lambda r: re.fullmatch("[a-z]{2}-[0-9]{3}", r.parsed)),
                          ("""--json '{"enum": ["red", "blue"]}'""", lambda r: r.parsed in ("red", "blue")),
                          ("--choice 'yes|no|unsure'", lambda r: r.parsed in ("yes", "no", "unsure")),
                          ("--choice labels", lambda r: r.parsed in ("cat", "dog")),
                          ("--grammar lark", lambda r: re.fullmatch(r"\([0-9]{1,2}\)", r.parsed))):
        res, out, err = run(ip, capsys, f"{GEN} {option}\nDescribe a pet.")
        assert res.success, (option, err)
        r = ip.user_ns["r"]
        assert check(r), (option, r.text)
        assert r.text in out and "ended (end-of-sequence token) · " in r.footer() and " complete · " in r.footer(), r.footer()
    res, _, err = run(ip, capsys, "%%generate --max-tokens 3 --json Pet --out r\nDescribe a pet.")
    assert res.success, err
    assert ip.user_ns["r"].parsed is None and "incomplete JSON (max tokens)" in ip.user_ns["r"].footer()
    res, _, err = run(ip, capsys, "%%generate --max-tokens 20 --out r\nDescribe a pet.")
    assert ip.user_ns["r"].parsed is None and "complete" not in ip.user_ns["r"].footer()


def test_logprobs_under_a_constraint_say_so(ip, capsys):
    res, out, err = run(ip, capsys, f"{GEN} --choice 'yes|no' --logprobs 3\nIs it?")
    assert res.success, err
    assert "alternatives   (constrained)" in out
    tokenizer = engine(ip).models.get().tokenizer
    assert {tokenizer.decode([t]) for t, _ in ip.user_ns["r"].logprobs[0].top} == {"y", "n"}


def test_a_batch_over_a_dataframe_gives_a_column_per_field(ip, capsys):
    import pandas as pd

    ip.user_ns.update(Pet=Pet, df=pd.DataFrame({"animal": ["cat", "spider", "bird"]}, index=["a", "b", "c"]))
    res, out, err = run(ip, capsys, "%%generate --batch df --json Pet --max-tokens 200 --out t\nDescribe a {animal}.")
    assert res.success, err
    t = ip.user_ns["t"]
    # the DataFrame's own columns first, the answer and its fields, the whole prompt last (issue 50's table)
    assert list(t.columns[:4]) == ["animal", "text", "name", "legs"] and list(t.index) == ["a", "b", "c"]
    assert t.columns[-1] == "prompt"
    assert "ram" in t.columns and "incomplete" in t.columns
    for (_, row), r in zip(t.iterrows(), t.attrs["results"]):
        assert isinstance(r.parsed, Pet) and (row["name"], row["legs"]) == (r.parsed.name, r.parsed.legs)
    res, out, err = run(ip, capsys, "%%generate --batch df --json Pet --max-tokens 4 --out t\nDescribe a {animal}.")
    assert "3 of 3 answers: incomplete JSON (max tokens)" in out
    assert ip.user_ns["t"]["incomplete"].tolist() == ["incomplete JSON (max tokens)"] * 3
    res, out, err = run(ip, capsys, "%%generate --batch df --choice 'yes|no' --max-tokens 20 --out t\nIs a {animal} a pet?")
    assert res.success and set(ip.user_ns["t"]["text"]) <= {"yes", "no"}


def test_bad_constraint_options_are_one_line_errors(ip, capsys):
    ip.user_ns.update(number=3, Pet=Pet)
    assert "--json nope: not a defined variable" in usage_error(ip, capsys, f"{GEN} --json nope\nhi")
    assert "response_format must be a Pydantic model class or a JSON Schema dict, got int" in usage_error(
        ip, capsys, f"{GEN} --json number\nhi")
    assert "--regex and --choice: one constraint at a time" in usage_error(
        ip, capsys, f"{GEN} --regex a --choice b\nhi")
    assert "--grammar number: needs a variable holding a Lark or GBNF grammar" in usage_error(
        ip, capsys, f"{GEN} --grammar number\nhi")
    assert "cannot compile the regex" in usage_error(ip, capsys, f"{GEN} --regex 'a(b'\nhi")
    ip.user_ns["qs"] = ["a", "b"]
    assert usage_error(ip, capsys, f"{GEN} --batch qs --regex 'a(b'\n{{item}}").startswith("cannot compile the regex")
