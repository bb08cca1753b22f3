"""``%%generate`` as people chat with modern models, in the in-process IPython shell on tiny models of each
chat family: the reasoning apart from the answer, template options a session keeps, notebook functions as
tools (each call and its result shown, the steps in the footer), --confirm, another chat template at load,
and bad options as one line."""

from __future__ import annotations

from magics_shell import engine, run, usage_error

TOOLS = '''
from typing import Literal
ran = []

def weather(city: Literal["paris", "oslo"]) -> dict:
    """The weather.

    Args:
        city: The city
    """
    ran.append(city)
    return {"city": city, "celsius": 21}
'''


def load(ip, capsys, path, name: str, extra: str = "") -> str:
    res, out, err = run(ip, capsys, f"%model load {path} --name {name} {extra}")
    assert res.success, err
    return out


def test_reasoning_shows_apart_and_a_session_keeps_its_template_options(ip, capsys, chat_model):
    load(ip, capsys, chat_model("qwen3"), "q")
    vocab = engine(ip).models.get("q").tokenizer.get_vocab()
    ip.user_ns["forced"] = f'start: <[{vocab["<think>"]}]> "\\nWeigh it.\\n" <[{vocab["</think>"]}]> "\\n\\nIt is."\n'
    res, out, err = run(ip, capsys, "%%generate --model q --session s --grammar forced --max-tokens 40 --out r\nWhy?")
    assert res.success, err
    r = ip.user_ns["r"]
    assert (r.reasoning, r.text) == ("Weigh it.", "It is.")
    assert "[thinking] Weigh it." in out and "<think>" not in out
    res, out, err = run(ip, capsys, "%%generate --model q --session s --no-think --max-tokens 4 --out r\nAnd?")
    assert res.success, err
    assert "the template dropped 11 reasoning tokens of turn 1" in ip.user_ns["r"].footer()
    assert engine(ip).sessions.get("s").template_args == {"enable_thinking": False}
    res, out, _ = run(ip, capsys, "%session show s")
    assert "[assistant] It is. (thought 2 words)" in out
    load(ip, capsys, chat_model("gpt-oss"), "g")
    res, _, err = run(ip, capsys, "%%generate --model g --session o --template-arg reasoning_effort=low "
                                  "--template-arg verbose=true --max-tokens 2\nHi")
    assert res.success, err
    assert engine(ip).sessions.get("o").template_args == {"reasoning_effort": "low", "verbose": True}


def test_notebook_functions_are_tools_each_call_shows_and_confirm_asks_first(ip, capsys, chat_model, monkeypatch):
    load(ip, capsys, chat_model("hermes"), "h")
    ip.run_cell(TOOLS)
    cell = "%%generate --model h --session t --tools weather --tool-choice required --max-steps 2 --max-tokens 200"
    res, out, err = run(ip, capsys, f"{cell} --out r\nWeather in Oslo?")
    assert res.success, err
    r = ip.user_ns["r"]
    assert len(r.steps) == 2 and len(ip.user_ns["ran"]) == 2
    assert out.count("[tool] weather(city=") == 2 and '"celsius": 21}' in out
    assert "2 tool steps (prefilled " in r.footer()
    res, out, err = run(ip, capsys, "%session show t")
    assert res.success and out.count("[assistant]  -> weather(city=") == 2 and out.count("[tool] {") == 2, out
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt: asked.append(prompt) or "n")
    res, out, err = run(ip, capsys, f"{cell} --confirm --out r\nAnd in Paris?")
    assert res.success, err
    assert len(asked) == 2 and asked[0].startswith("run weather(city=") and len(ip.user_ns["ran"]) == 2
    assert "Error: the user declined this call" in out


def test_another_chat_template_at_load(ip, capsys, tmp_path, tiny_model_dir):
    from chat_models import QWEN3

    (tmp_path / "q.jinja").write_text(QWEN3)
    out = load(ip, capsys, tiny_model_dir, "t", f"--chat-template {tmp_path / 'q.jinja'}")
    assert f"chat template {tmp_path / 'q.jinja'}" in out
    res, _, err = run(ip, capsys, "%%generate --model t --no-think --max-tokens 2 --out r\nHi")
    assert res.success, err
    assert "--chat-template only apply to %model load" in usage_error(ip, capsys, "%model list --chat-template x")


def test_bad_chat_options_are_one_line(ip, capsys, chat_model):
    load(ip, capsys, chat_model("hermes"), "h")
    ip.run_cell(TOOLS)
    gen = "%%generate --model h --max-tokens 4"
    for option, words in (("--think --no-think", "contradict"), ("--tools nope", "not a function defined"),
                          ("--tool-choice required", "go with --tools"), ("--template-arg x", "KEY=VALUE"),
                          ("--batch items --think", "single cells"), ("--think", "no thinking switch"),
                          ("--tools weather --tool-choice always", "invalid choice")):
        ip.user_ns["items"] = ["a"]
        assert words in usage_error(ip, capsys, f"{gen} {option}\nHi"), option


def test_in_a_kernel_the_reasoning_is_a_collapsed_area_above_the_answer(start_kernel, chat_model):
    k = start_kernel()
    assert k.execute(f"%model load {chat_model('qwen3')} --name q")["status"] == "ok"
    assert k.execute("v = get_ipython().mlxcache.engine.models.get('q').tokenizer.get_vocab()\n"
                     "forced = f'start: <[{v[\"<think>\"]}]> \"\\\\nWeigh it.\\\\n\" <[{v[\"</think>\"]}]> \"\\\\n\\\\nIt is.\"'"
                     )["status"] == "ok"
    msgs = []
    reply = k.kc.execute_interactive("%%generate --model q --grammar forced --max-tokens 40\nWhy?",
                                     output_hook=msgs.append, timeout=300)
    assert reply["content"]["status"] == "ok"
    order = [(m["msg_type"], m["content"]) for m in msgs if m["msg_type"] in ("display_data", "update_display_data",
                                                                               "stream")]
    shown = [c["data"]["text/html"] for t, c in order if t.endswith("display_data") and "mlxc-thinking" in
             c["data"].get("text/html", "")]
    assert shown and shown[0].startswith("<details class='mlxc-thinking'") and "Weigh it." in shown[-1]
    first_thinking = next(i for i, (t, c) in enumerate(order) if t == "display_data" and "mlxc-thinking" in
                          c["data"].get("text/html", ""))
    streamed = [(i, c["text"]) for i, (t, c) in enumerate(order) if t == "stream" and c["text"].strip()]
    assert "".join(text for _, text in streamed).strip() == "It is." and first_thinking < streamed[0][0]
