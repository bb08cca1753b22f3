"""A reply split into reasoning, answer and tool-call text however it streams; the notebook's functions as
tools (schemas from signatures and docstrings, calls parsed from each family's format, run with their
exceptions as results); the grammar of a required call accepts the family's call written as the template
renders it back, and nothing else."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from mlxcache_kernel.engine import ToolError
from mlxcache_kernel.engine.chat.reasoning import Split, starts_in_reasoning
from mlxcache_kernel.engine.chat.templates import Family, family_of
from mlxcache_kernel.engine.chat.tools import Toolbox, ToolCall, call_grammar, parse_calls

QWEN = Family("hermes", ("<think>", "</think>"), "reasoning_content")
HARMONY = Family("harmony", None, "thinking")


def lookup(city: Literal["paris", "oslo"], days: int = 1) -> dict:
    """Look up the weather.

    Args:
        city: The city
        days: Days ahead
    """
    if days < 0:
        raise ValueError("days must be >= 0")
    return {"city": city, "days": days}


def streamed(split: Split, text: str, size: int) -> list:
    shown = []
    for i in range(0, len(text), size):
        shown += split.feed(text[i:i + size])
    return shown + split.finish()


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_think_blocks_and_calls_split_the_same_however_the_text_streams(size):
    text = '<think>\nWeigh it.\n</think>\n\nCalling <tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'
    split = Split(QWEN)
    shown = streamed(split, text, size)
    assert split.reasoning == "\nWeigh it.\n" and split.answer.strip() == "Calling"
    assert split.calls == [(None, '\n{"name": "lookup", "arguments": {}}\n')]
    assert "".join(t for c, t in shown if c == "reasoning") == split.reasoning
    assert "".join(t for c, t in shown if c == "answer") == split.answer  # no marker shown, none lost
    assert not any("<" in t for _, t in shown)


def test_a_prompt_that_opens_the_reasoning_block_starts_the_reply_inside_it():
    assert starts_in_reasoning(QWEN, "<｜Assistant｜><think>\n") and not starts_in_reasoning(QWEN, "<think>a</think>")
    split = Split(QWEN, in_reasoning=True)
    streamed(split, "still thinking</think>answer", 3)
    assert (split.reasoning, split.answer) == ("still thinking", "answer")


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_harmony_channels_analysis_final_and_a_call_to_a_function(size):
    text = ("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant to=functions.lookup<|channel|>commentary json"
            '<|message|>{"city": "oslo"}')
    split = Split(HARMONY)
    streamed(split, text, size)
    assert split.reasoning == "Hmm." and split.answer == "" and split.calls == [("lookup", '{"city": "oslo"}')]
    split = Split(HARMONY)
    streamed(split, "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>final<|message|>Done", size)
    assert (split.reasoning, split.answer, split.calls) == ("A", "Done", [])


def test_schemas_come_from_signatures_and_docstrings_and_a_function_without_one_is_refused_in_one_line():
    box = Toolbox([lookup])
    params = box.schemas[0]["function"]["parameters"]
    assert box.names == ["lookup"] and params["properties"]["city"]["enum"] == ["paris", "oslo"]
    assert params["required"] == ["city"] and params["properties"]["days"]["description"] == "Days ahead"

    def bare(x):
        return x

    with pytest.raises(ToolError, match="tool 'bare'.*docstring") as e:
        Toolbox([bare])
    assert "\n" not in str(e.value)
    with pytest.raises(ToolError, match="list of functions"):
        Toolbox(lookup)


def test_a_tools_exception_and_an_unknown_tool_are_results_the_model_reads():
    box = Toolbox([lookup])
    assert box.run(ToolCall("lookup", {"city": "oslo", "days": 2}, "c1")).text == '{"city": "oslo", "days": 2}'
    failed = box.run(ToolCall("lookup", {"city": "oslo", "days": -1}, "c2"))
    assert failed.result is None and failed.text == "Error: ValueError: days must be >= 0"
    assert "unknown tool 'nope'" in box.run(ToolCall("nope", {}, "c3")).text
    assert "unexpected keyword" in box.run(ToolCall("lookup", {"town": "x"}, "c4")).text


def test_calls_are_read_from_each_familys_format():
    ids = iter(f"call{i:05d}" for i in range(1, 100))
    nxt = lambda: next(ids)  # noqa: E731
    hermes = parse_calls(QWEN, [(None, '\n{"name": "lookup", "arguments": {"city": "oslo"}}\n')], "", nxt)
    llama = parse_calls(Family("llama3"), [], '{"name": "lookup", "parameters": {"city": "paris"}}', nxt)
    mistral = parse_calls(Family("mistral"), [(None, 'lookup[ARGS]{"city": "oslo"}')], "", nxt)
    harmony = parse_calls(HARMONY, [("lookup", '{"city": "oslo"}')], "", nxt)
    assert [(c.name, c.arguments, c.id) for c in hermes + llama + mistral + harmony] == [
        ("lookup", {"city": "oslo"}, "call00001"), ("lookup", {"city": "paris"}, "call00002"),
        ("lookup", {"city": "oslo"}, "call00003"), ("lookup", {"city": "oslo"}, "call00004")]
    assert parse_calls(QWEN, [(None, "{not json")], "", nxt) == []  # not a call: the reply is an answer
    assert parse_calls(Family("llama3"), [], "plain words", nxt) == []


CALLS = {  # family -> (a call as its template renders it back, the same call written otherwise)
    "qwen3": ('<tool_call>\n{"name": "lookup", "arguments": {"city": "oslo", "days": 2}}\n</tool_call>',
              '<tool_call>\n{"name": "lookup", "arguments": {"city":"oslo", "days": 2}}\n</tool_call>'),
    "llama32": ('{"name": "lookup", "parameters": {"city": "oslo", "days": 2}}<|eot_id|>',
                '{"name": "lookup", "parameters": {"city": "rome", "days": 2}}<|eot_id|>'),
    "gpt-oss": (' to=functions.lookup<|channel|>commentary json<|message|>{"city": "oslo", "days": 2}<|call|>',
                '<|channel|>commentary to=functions.lookup json<|message|>{"city": "oslo", "days": 2}<|call|>'),
    "mistral": ('[TOOL_CALLS]lookup[ARGS]{"city": "oslo", "days": 2}',
                '[TOOL_CALLS]lookup[ARGS]{"city": "oslo", "days": 2, "x": 1}'),
}


@pytest.mark.parametrize("family", sorted(CALLS))
def test_the_grammar_of_a_required_call_takes_the_call_as_rendered_and_refuses_other_writings(tokenizer_of, family):
    from llguidance import LLMatcher, LLTokenizer, grammar_from

    tok = tokenizer_of(family)
    llt = LLTokenizer(tok._tokenizer.backend_tokenizer.to_str(), eos_token=sorted(tok.eos_token_ids))
    grammar = grammar_from("lark", call_grammar(family_of(tok), Toolbox([lookup]).schemas, tok.get_vocab(), False))
    assert LLMatcher.validate_grammar(grammar, llt) == ""

    def accepts(text: str) -> bool:
        m = LLMatcher(llt, grammar, log_level=0)
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()

    good, other = CALLS[family]
    assert accepts(good) and not accepts(other)


def test_with_thinking_the_grammar_lets_a_reasoning_block_come_first(tokenizer_of):
    from llguidance import LLMatcher, LLTokenizer, grammar_from

    tok = tokenizer_of("qwen3")
    llt = LLTokenizer(tok._tokenizer.backend_tokenizer.to_str(), eos_token=sorted(tok.eos_token_ids))
    grammar = grammar_from("lark", call_grammar(family_of(tok), Toolbox([lookup]).schemas, tok.get_vocab(), True))
    call = CALLS["qwen3"][0]
    for text, ok in ((call, True), (f"<think>\nFirst this.\n</think>\n\n{call}", True),
                     (f"<think>\n\nFirst this.\n</think>\n\n{call}", False),  # not as the template renders it
                     (f"<think>\nno </think> inside\n</think>\n\n{call}", False)):
        m = LLMatcher(llt, grammar, log_level=0)
        assert (all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()) == ok
    assert json.loads(CALLS["qwen3"][0].split("\n")[1])["arguments"]["city"] == "oslo"
