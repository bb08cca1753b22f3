"""Tiny random models that chat as modern model families do: each family's special tokens and a chat
template written for the tests that reproduces what the real one (llama.cpp's models/templates/) does
to the cache: Qwen3 drops the reasoning of assistant turns before the last user query (read from its
reasoning_content, or split out of its content at </think>) and keeps it after it, writes an empty think block with enable_thinking=false and returns tool results as a user
turn in <tool_response>; Llama 3.2 writes today's date into the system header (strftime_now) and
takes a tool call as the JSON answer; gpt-oss writes the date too, talks on channels, calls tools on
the commentary channel (rendered with the recipient in the role, as its template does) and drops the
analysis of a tool call once a final message follows; Hermes (and Qwen2.5) call tools as Qwen3 does,
without thinking; Mistral Small 3.2 puts the tools before the
last user message and numbers tool calls with 9-character ids.

`build_chat_model(path, family)`; `real_template(family)` reads the real template from the directory
MLXCACHE_REAL_TEMPLATES names (the files are not in this repository), or None.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tiny_model import build_tiny_model, save_byte_level_tokenizer

# ChatML with tools in the system turn and tool results as a user turn (Qwen3, Qwen2.5, Hermes)
CHATML_TOOLS = r"""
{%- if tools %}{{- '<|im_start|>system\n' }}{% if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}
{{- '# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}
{{- '\n</tools>\nCall one with <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{% endif %}
"""
TOOL_RESPONSES = r"""
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}
{%- endif %}{% endfor %}
"""

QWEN3 = CHATML_TOOLS + r"""{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set content = m.content %}{% set reasoning = '' %}
{%- if m.reasoning_content is defined and m.reasoning_content is not none %}{% set reasoning = m.reasoning_content %}
{%- elif '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}{{ '<|im_start|>assistant\n' + content }}{% endif %}
{%- if m.tool_calls %}{% for call in m.tool_calls %}{% if not loop.first or content %}{{ '\n' }}{% endif %}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}{% endfor %}{% endif %}
{{- '<|im_end|>\n' }}
""" + TOOL_RESPONSES + r"""{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"""

# Hermes / Qwen2.5: Qwen3's tool format without thinking
HERMES = CHATML_TOOLS + r"""{%- for m in messages %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant' }}{% if m.content %}{{ '\n' + m.content }}{% endif %}
{%- if m.tool_calls %}{% for call in m.tool_calls %}{{ '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}{% endfor %}{% endif %}
{{- '<|im_end|>\n' }}
""" + TOOL_RESPONSES + r"""{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

LLAMA32 = r"""{{- bos_token }}
{%- if not date_string is defined %}{% set date_string = strftime_now("%d %b %Y") %}{% endif %}
{%- if messages[0].role == 'system' %}{% set system = messages[0].content | trim %}{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}{% if tools %}{{ 'Environment: ipython\n' }}{% endif %}
{{- 'Today Date: ' + date_string + '\n\n' }}
{%- if tools %}{{ 'Answer a call as {"name": function name, "parameters": dictionary of arguments}.\n\n' }}
{%- for t in tools %}{{ t | tojson(indent=4) }}{{ '\n\n' }}{% endfor %}{% endif %}
{{- system + '<|eot_id|>' }}
{%- for m in messages %}
{%- if m.role == 'tool' %}{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}
{%- elif 'tool_calls' in m %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + m.tool_calls[0].function.name + '", "parameters": ' + (m.tool_calls[0].function.arguments | tojson) + '}<|eot_id|>' }}
{%- else %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

GPT_OSS = r"""
{{- '<|start|>system<|message|>You are a tiny test model.\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\nReasoning: ' }}
{{- (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n# Valid channels: analysis, commentary, final.<|end|>' }}
{%- if messages[0].role == 'system' %}{% set dev = messages[0].content %}{% set loop_messages = messages[1:] %}
{%- else %}{% set dev = '' %}{% set loop_messages = messages %}{% endif %}
{%- if dev or tools %}{{ '<|start|>developer<|message|>' + dev }}{% if tools %}{{ '\n# Tools\n' }}
{%- for t in tools %}{{ t.function.name + ': ' + (t.function.parameters | tojson) + '\n' }}{% endfor %}{% endif %}{{ '<|end|>' }}{% endif %}
{%- set last = namespace(name=none) %}
{%- for m in loop_messages %}
{%- if m.role == 'assistant' and 'tool_calls' in m %}
{%- set ns = namespace(final=false) %}
{%- for f in loop_messages[loop.index:] %}{% if f.role == 'assistant' and 'tool_calls' not in f %}{% set ns.final = true %}{% endif %}{% endfor %}
{%- if m.thinking and not ns.final %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{% endif %}
{{- '<|start|>assistant to=functions.' + m.tool_calls[0].function.name + '<|channel|>commentary json<|message|>' }}
{{- (m.tool_calls[0].function.arguments | tojson) + '<|call|>' }}{% set last.name = m.tool_calls[0].function.name %}
{%- elif m.role == 'assistant' %}{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'tool' %}{{ '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' + (m.content | tojson) + '<|end|>' }}
{%- else %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""

MISTRAL = r"""{{- bos_token + '[SYSTEM_PROMPT]Today is ' + strftime_now('%Y-%m-%d') + '.' }}
{%- if messages[0].role == 'system' %}{{ ' ' + messages[0].content }}{% set loop_messages = messages[1:] %}
{%- else %}{% set loop_messages = messages %}{% endif %}{{ '[/SYSTEM_PROMPT]' }}
{%- set users = loop_messages | selectattr('role', 'equalto', 'user') | list %}
{%- for m in loop_messages %}
{%- if m.role == 'user' %}{% if tools and m == users[-1] %}{{ '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}{% endif %}
{{- '[INST]' + m.content + '[/INST]' }}
{%- elif m.role == 'assistant' and m.tool_calls %}{% for call in m.tool_calls %}
{%- if call.id is not string or call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{{- '[TOOL_CALLS]' + call.function.name + '[CALL_ID]' + call.id + '[ARGS]' + call.function.arguments | tojson }}{% endfor %}{{ eos_token }}
{%- elif m.role == 'assistant' %}{{ m.content + eos_token }}
{%- elif m.role == 'tool' %}{{ '[TOOL_RESULTS]' + m.tool_call_id + '[TOOL_CONTENT]' + m.content + '[/TOOL_RESULTS]' }}{% endif %}
{%- endfor %}"""

# family: (template, special tokens, added tokens that are not special, bos, eos, the end tokens of a reply)
FAMILIES = {
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              None, "<|im_end|>", ["<|im_end|>"]),
    "hermes": (HERMES, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
               ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"], None, "<|im_end|>", ["<|im_end|>"]),
    "llama32": (LLAMA32, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                          "<|eom_id|>", "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>",
                ["<|eot_id|>", "<|eom_id|>"]),
    "gpt-oss": (GPT_OSS, ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                          "<|return|>", "<|call|>"], [], None, "<|return|>", ["<|return|>", "<|call|>"]),
    "mistral": (MISTRAL, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
                          "[CALL_ID]", "[ARGS]", "[TOOL_CONTENT]"], [], "<s>", "</s>", ["</s>"]),
}
# the real template of each family, as llama.cpp's models/templates/ names it
REAL_FILES = {"qwen3": "Qwen-Qwen3-0.6B.jinja", "hermes": "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "llama32": "meta-llama-Llama-3.2-3B-Instruct.jinja",
              "gpt-oss": "openai-gpt-oss-120b.jinja", "mistral": "Mistral-Small-3.2-24B-Instruct-2506.jinja"}


def real_template(family: str) -> str | None:
    root = os.environ.get("MLXCACHE_REAL_TEMPLATES")
    path = Path(root) / REAL_FILES[family] if root else None
    return path.read_text() if path is not None and path.is_file() else None


def build_chat_model(path, family: str, *, template: str | None = None, seed: int = 0) -> Path:
    """A tiny random llama model with `family`'s tokens and test template (or `template`)."""
    chat_template, specials, plain, bos, eos, ends = FAMILIES[family]
    def tokenizer(p: Path) -> int:
        vocab = save_byte_level_tokenizer(p, specials, plain)
        (p / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "pad_token": specials[0], "unk_token": specials[0], "chat_template": template or chat_template,
            "model_max_length": 8192}))
        return vocab

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return build_tiny_model(path, seed=seed, tokenizer=tokenizer, eos_token_id=[specials.index(t) for t in ends])
