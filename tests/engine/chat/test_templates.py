"""Chat templates: what each family's template does to the cache, as the test templates reproduce it
(tests/support/chat_models.py) and, where MLXCACHE_REAL_TEMPLATES names a directory holding llama.cpp's
models/templates/ files, as the real templates do; template options, the thinking switch, the pinned
clock and templates read from files."""

from __future__ import annotations

import json
import time
from datetime import datetime

import pytest

from chat_models import real_template
from mlxcache_kernel.engine import GenerationError, ModelError
from mlxcache_kernel.engine.chat.templates import family_of, read_template, render, template_options

CALL = {"id": "call00001", "type": "function", "function": {"name": "lookup", "arguments": {"city": "oslo"}}}
TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look up.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "A city"}}, "required": ["city"]}}}
FAMILIES = ("qwen3", "llama32", "gpt-oss", "mistral")


def templates(family: str) -> list:
    """The test template (None: the tokenizer's own) and the real one where the files are available."""
    real = real_template(family)
    return [pytest.param(None, id="test")] + ([pytest.param(real, id="real")] if real else [])


def both(family: str) -> list:
    return [pytest.param(family, p.values[0], id=f"{family}-{p.id}") for p in templates(family)]


def reasoned_turns(field: str) -> list:
    return [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", field: "R-one"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "", field: "R-two", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call00001", "name": "lookup", "content": "sunny"}]


@pytest.mark.parametrize("template", templates("qwen3"))
def test_qwen3_drops_reasoning_before_the_last_query_keeps_it_after_and_returns_tools_as_a_user_turn(
        tokenizer_of, template):
    tok = tokenizer_of("qwen3", template)
    text = render(tok, reasoned_turns("reasoning_content"), tools=[TOOL])
    assert "R-one" not in text and "<think>\nR-two\n</think>\n\n<tool_call>" in text  # after Q2: kept
    assert '<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    off = render(tok, [{"role": "user", "content": "Q"}], options=template_options(tok, None, False))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert family_of(tok).name == "hermes" and family_of(tok).field == "reasoning_content"
    inline = render(tok, [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nR-x\n</think>"
                          "\n\nA1"}, {"role": "user", "content": "Q2"}])  # reasoning left in the content: split out
    assert "R-x" not in inline and "<|im_start|>assistant\nA1<|im_end|>" in inline


@pytest.mark.parametrize("family,template", both("llama32") + both("gpt-oss") + both("mistral"))
def test_dated_templates_render_the_pinned_clock_and_today_without_one(tokenizer_of, family, template):
    tok = tokenizer_of(family, template)
    messages = [{"role": "user", "content": "Q"}]  # (the real Mistral dates its default system prompt)
    fmt = {"llama32": "%d %b %Y", "gpt-oss": "%Y-%m-%d", "mistral": "%Y-%m-%d"}[family]
    day = time.time() - 3 * 86400
    assert datetime.fromtimestamp(day).strftime(fmt) in render(tok, messages, clock=day)
    assert datetime.now().strftime(fmt) in render(tok, messages)
    assert render(tok, messages, clock=day) == render(tok, messages, clock=day + 1)


@pytest.mark.parametrize("template", templates("gpt-oss"))
def test_gpt_oss_calls_on_commentary_and_drops_a_calls_analysis_once_a_final_message_follows(tokenizer_of, template):
    tok = tokenizer_of("gpt-oss", template)
    loop = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "thinking": "Think-a",
                                                "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call00001", "name": "lookup", "content": "sunny"}]
    during = render(tok, loop, tools=[TOOL])
    assert "<|channel|>analysis<|message|>Think-a<|end|>" in during
    assert "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>" in during
    after = render(tok, loop + [{"role": "assistant", "content": "Done"}, {"role": "user", "content": "Q2"}],
                   tools=[TOOL])
    assert "Think-a" not in after and "<|channel|>final<|message|>Done" in after
    assert "Reasoning: low" in render(tok, loop, tools=[TOOL], options={"reasoning_effort": "low"})
    assert family_of(tok).name == "harmony" and family_of(tok).field == "thinking"


@pytest.mark.parametrize("template", templates("mistral"))
def test_mistral_puts_the_tools_before_the_last_user_message(tokenizer_of, template):
    tok = tokenizer_of("mistral", template)
    first = render(tok, [{"role": "user", "content": "Q1"}], tools=[TOOL], generation_prompt=False)
    second = render(tok, [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                          {"role": "user", "content": "Q2"}], tools=[TOOL], generation_prompt=False)
    assert first.index("[AVAILABLE_TOOLS]") < first.index("Q1")
    assert second.index("Q1") < second.index("[AVAILABLE_TOOLS]") < second.index("Q2")  # the prefix moves
    with pytest.raises(GenerationError, match="refused this conversation"):
        bad = dict(CALL, id="short")
        render(tok, [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [bad]}])


@pytest.mark.parametrize("family,template", both("llama32"))
def test_llama_takes_a_call_as_json_and_returns_results_as_ipython(tokenizer_of, family, template):
    tok = tokenizer_of(family, template)
    text = render(tok, [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "call00001", "content": "sunny"}], tools=[TOOL])
    assert '{"name": "lookup", "parameters": {"city": "oslo"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>" in text
    assert family_of(tok).name == "llama3"


def test_thinking_switch_is_the_templates_own_keyword_and_refused_where_there_is_none(tokenizer_of):
    assert template_options(tokenizer_of("qwen3"), {"x": 1}, True) == {"x": 1, "enable_thinking": True}
    with pytest.raises(GenerationError, match="no thinking switch"):
        template_options(tokenizer_of("llama32"), None, False)
    with pytest.raises(GenerationError, match="not a template keyword"):
        template_options(tokenizer_of("qwen3"), {"not valid": 1}, None)


def test_templates_are_read_from_jinja_files_tokenizer_configs_or_text(tmp_path):
    text = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": text}))
    assert read_template(tmp_path / "t.jinja") == read_template(tmp_path / "tokenizer_config.json") == text
    assert read_template(text) == text
    with pytest.raises(ModelError, match="neither a file nor a Jinja template"):
        read_template(tmp_path / "missing.jinja")
