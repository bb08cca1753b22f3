"""Chat turns through the engine: reasoning apart from the answer and stored where the template reads it,
a template that drops earlier reasoning costs only the tokens it changed (and the footer says why),
template options a session remembers, dates that stay put in a session, another chat template at load."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from mlxcache_kernel.engine import Engine, GenerationError, ModelError


def common_prefix_len(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture
def engine(tmp_path):
    engines = []

    def make(model_dir, **kw):
        eng = Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0, **kw)
        eng.load_model(model_dir, name="m")
        engines.append(eng)
        return eng

    yield make
    for e in engines:
        e.close()


def forced(tok, reasoning: str, answer: str) -> str:
    """A Lark grammar of exactly `<think>reasoning</think>answer`, the markers as their tokens."""
    v = tok.get_vocab()
    return f'start: <[{v["<think>"]}]> "\\n{reasoning}\\n" <[{v["</think>"]}]> "\\n\\n{answer}"\n'


def test_reasoning_streams_apart_is_stored_where_the_template_reads_it_and_its_drop_costs_only_what_changed(
        engine, chat_model):
    eng = engine(chat_model("qwen3"))
    tok = eng.models.get("m").tokenizer
    shown, thought = [], []
    r1 = eng.generate("Q1", session="s", grammar=forced(tok, "Weigh one.", "Answer one."), max_tokens=64,
                      on_text=shown.append, on_reasoning=thought.append)
    assert (r1.reasoning, r1.text) == ("Weigh one.", "Answer one.")
    assert "".join(thought).strip() == "Weigh one." and "".join(shown).strip() == "Answer one."
    s = eng.sessions.get("s")
    assert s.messages[-1] == {"role": "assistant", "content": "Answer one.", "reasoning_content": "\nWeigh one.\n"}
    r2 = eng.generate("Q2", session="s", grammar=forced(tok, "Weigh two.", "Answer two."), max_tokens=64)
    ids1, ids2 = r1.prompt_tokens + r1.tokens, r2.prompt_tokens
    assert ids2[:len(r1.prompt_tokens)] == r1.prompt_tokens  # kept up to the reply the template rewrote
    changed = len(ids2) - common_prefix_len(ids1, ids2)
    assert r2.stats["prefilled_tokens"] == changed == len(ids2) - len(r1.prompt_tokens)
    dropped = len(tok.encode("\nWeigh one.\n", add_special_tokens=False))
    assert r2.stats["prefill_note"] == f"the template dropped {dropped} reasoning tokens of turn 1"
    r3 = eng.generate("Q3", session="s", max_tokens=4)  # turn 2's reasoning dropped now, turn 1's long gone
    assert "turn 2" in r3.stats["prefill_note"] and "Weigh" not in tok.decode(r3.prompt_tokens)


def test_think_off_and_template_args_render_and_a_session_remembers_them(engine, chat_model):
    eng = engine(chat_model("qwen3"))
    tok = eng.models.get("m").tokenizer
    r = eng.generate("Q1", session="s", think=False, max_tokens=4)
    assert tok.decode(r.prompt_tokens).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    r = eng.generate("Q2", session="s", max_tokens=4)  # remembered
    assert tok.decode(r.prompt_tokens).endswith("<think>\n\n</think>\n\n")
    assert eng.sessions.get("s").template_args == {"enable_thinking": False}
    r = eng.generate("Q3", max_tokens=4)  # a one-off call has its own options
    assert tok.decode(r.prompt_tokens).endswith("<|im_start|>assistant\n")
    eng.sessions.new("pre", template_args={"enable_thinking": False})  # a session's options from its start
    assert tok.decode(eng.generate("Q", session="pre", max_tokens=2).prompt_tokens).endswith("</think>\n\n")
    oss = engine(chat_model("gpt-oss"))
    tok = oss.models.get("m").tokenizer
    r = oss.generate("Q", session="o", template_args={"reasoning_effort": "low"}, max_tokens=4)
    assert "Reasoning: low" in tok.decode(r.prompt_tokens)
    assert "Reasoning: low" in tok.decode(oss.generate("Q2", session="o", max_tokens=4).prompt_tokens)
    with pytest.raises(GenerationError, match="no thinking switch"):
        oss.generate("Q", think=False)
    with pytest.raises(GenerationError, match="chat template"):
        oss.generate("Q", raw=True, think=True)


def test_a_session_keeps_the_date_it_was_created_on_so_yesterdays_conversation_hits_today(engine, chat_model):
    eng = engine(chat_model("llama32"))
    tok = eng.models.get("m").tokenizer
    s = eng.sessions.new("d")
    s.clock -= 2 * 86400  # created two days ago: the clock its template reads stays there
    then, today = (datetime.fromtimestamp(s.clock).strftime("%d %b %Y"), datetime.now().strftime("%d %b %Y"))
    r1 = eng.generate("Q1", session="d", max_tokens=6)
    r2 = eng.generate("Q2", session="d", max_tokens=6)
    assert f"Today Date: {then}" in tok.decode(r2.prompt_tokens)
    kept = len(r1.prompt_tokens) + len(r1.tokens)
    assert r2.prompt_tokens[:kept] == r1.prompt_tokens + r1.tokens
    assert r2.stats["prefilled_tokens"] == len(r2.prompt_tokens) - (kept - 1)  # the end token and the new turn
    assert r2.stats["prefill_note"] is None
    assert f"Today Date: {today}" in tok.decode(eng.generate("Q", max_tokens=2).prompt_tokens)  # one-off: today
    saved = eng.checkpoints.save("d-saved", session="d")
    eng.sessions.close("d")
    eng.checkpoints.restore("d-saved")  # the clock travels with the session's record
    r3 = eng.generate("Q3", session="d", max_tokens=6)
    assert f"Today Date: {then}" in tok.decode(r3.prompt_tokens) and saved["tokens"] > 0
    assert r3.stats["prefilled_tokens"] < len(r3.prompt_tokens) - saved["tokens"] + 2


def test_another_chat_template_at_load_and_a_bad_one_refused_before_loading(engine, tiny_model_dir, tmp_path):
    from chat_models import QWEN3

    (tmp_path / "qwen3.jinja").write_text(QWEN3)
    eng = engine(tiny_model_dir)
    info = eng.load_model(tiny_model_dir, name="q", chat_template=tmp_path / "qwen3.jinja")
    assert info["chat_template"] == str(tmp_path / "qwen3.jinja")
    r = eng.generate("Hi", model="q", think=False, max_tokens=2)
    assert eng.models.get("q").tokenizer.decode(r.prompt_tokens).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(GenerationError, match="no thinking switch"):
        eng.generate("Hi", model="m", think=False)  # the model's own template (ChatML) has none
    with pytest.raises(ModelError, match="neither a file nor a Jinja template"):
        eng.load_model(tiny_model_dir, name="bad", chat_template=tmp_path / "missing.jinja")
    assert "bad" not in eng.models.names()
    assert eng.load_model(tiny_model_dir, name="t", chat_template=QWEN3)["chat_template"] == "given"
