"""The agent loop: the notebook's functions as tools, called in the family's own format (forced through the
call grammar: tool_choice="required"), every step a cache hit: a step prefills only what it added (the tool
results and the template's glue), in RAM, after a restart (SSD) and on another machine (the team tier), with
the tokens of a cold run of every step; an exception in a tool is the model's result; an interrupt leaves
the session as it was and a rerun continues without running a tool twice, also after kill -9."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Literal

import pytest

import agent_tools
from agent_tools import LOOP, QUESTION, SYSTEM, TOOLS, summary
from repo_paths import SUPPORT

from mlxcache_kernel.engine import Engine, ToolError
from mlxcache_kernel.engine.chat.templates import family_of
from mlxcache_kernel.engine.chat.tools import Toolbox, call_grammar

HITTING = ("hermes", "llama32", "gpt-oss")  # the families whose templates render a call back as the model wrote it


@pytest.fixture
def log(tmp_path, monkeypatch):
    path = tmp_path / "calls.log"
    monkeypatch.setattr(agent_tools, "LOG", path)
    monkeypatch.setattr(agent_tools, "OFFSET", 0)
    return path


def open_engine(cache_dir, model_dir, **kw) -> Engine:
    eng = Engine(cache_dir=cache_dir, prefetch_budget_bytes=0, **kw)
    eng.load_model(model_dir, name="m")
    return eng


def added(prev_prompt: list, prev_tokens: list, prompt: list) -> int:
    """What a step added to the previous step's prompt and reply: the tool results and the template's glue."""
    assert prompt[:len(prev_prompt) + len(prev_tokens)] == prev_prompt + prev_tokens  # the ids the model generated
    return len(prompt) - len(prev_prompt) - len(prev_tokens)


def walk(r) -> list:
    return [(s.prompt_tokens, s.tokens, s.stats) for s in r.steps] + [(r.prompt_tokens, r.tokens, r.stats)]


def check_every_step_hits(r, first_source=None, exact=True) -> None:
    """Each step prefills what it added (exact), or at most that where the cache knows more (another run's)."""
    steps = walk(r)
    if first_source is not None:
        assert steps[0][2]["cache_source"] == first_source
    for (p0, t0, _), (p1, _, stats) in zip(steps, steps[1:]):
        # (+1: the reply's end token, where decoding stopped before forwarding it: not pipelined)
        assert added(p0, t0, p1) - (0 if exact else len(p1)) <= stats["prefilled_tokens"] <= added(p0, t0, p1) + 1
        assert stats["prefill_note"] is None


@pytest.mark.parametrize("family", HITTING)
def test_a_six_step_loop_prefills_only_what_each_step_added_with_a_cold_runs_tokens(family, chat_model, tmp_path,
                                                                                   log):
    with open_engine(tmp_path / "c", chat_model(family)) as eng:
        seen = []
        r = eng.generate(QUESTION, session="s", system=SYSTEM, on_step=seen.append, **LOOP)
        assert len(r.steps) == 6 and seen == r.steps and len(log.read_text().splitlines()) == 6
        assert all(s.call in ("weather", "convert") and s.error is None for s in r.steps)
        check_every_step_hits(r)
        tok = eng.models.get("m").tokenizer
        for s in r.steps:  # each step's tokens: a cold run of its prompt under the same grammar
            assert s.grammar.startswith(call_grammar(family_of(tok), Toolbox(TOOLS).schemas, tok.get_vocab(), False)[:0])
            cold = eng.generate_tokens(s.prompt_tokens, use_cache=False, grammar=s.grammar, max_tokens=300, seed=0,
                                       lookup=False)
            assert cold.tokens == s.tokens
        assert eng.generate_tokens(r.prompt_tokens, use_cache=False, max_tokens=300, seed=0).tokens == r.tokens
        messages = eng.sessions.get("s").messages
        assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * 6 + ["assistant"]
        assert messages[-2]["content"] == r.steps[-1].calls[0].text


def test_after_a_restart_and_on_another_machine_the_loop_hits_every_step(chat_model, tmp_path, log, monkeypatch):
    from redis_servers import RedisServer, require

    require("redis")
    model = chat_model("hermes")
    server = RedisServer(tmp_path / "redis", password="pw-agent-loop").start()
    remote = dict(remote_url=server.url(password="pw-agent-loop"), remote_secret="team-secret-agent-loop")
    try:
        with open_engine(tmp_path / "a", model, **remote) as eng:
            first = eng.generate(QUESTION, session="s", system=SYSTEM, **LOOP)
            eng.flush()
        monkeypatch.setattr(agent_tools, "OFFSET", 7)  # the tools answer otherwise now: steps 2.. are new
        with open_engine(tmp_path / "a", model) as eng:  # a restart: RAM empty, the SSD tier holds step 1's state
            again = eng.generate(QUESTION, session="s", system=SYSTEM, **LOOP)
        assert again.steps[0].tokens == first.steps[0].tokens and again.steps[1].prompt_tokens != first.steps[1].prompt_tokens
        assert again.steps[0].stats["prefilled_tokens"] <= 1  # step 1's prompt: all of it from SSD
        check_every_step_hits(again, first_source="ssd", exact=False)  # (the first run's glue is cached too)
        with open_engine(tmp_path / "b", model, **remote) as eng:  # another machine, the team tier
            other = eng.generate(QUESTION, session="s", system=SYSTEM, **LOOP)
        assert other.steps[0].stats["prefilled_tokens"] <= 32  # whole 32-token blocks from the team tier
        check_every_step_hits(other, first_source="remote", exact=False)
    finally:
        server.stop()


def test_a_template_that_re_renders_tool_results_costs_what_it_changed_and_says_so(chat_model, tmp_path, log):
    from chat_models import HERMES, TOOL_RESPONSES, build_chat_model

    # Hermes-3's own template writes a tool result one way while it is the last message, another way after
    last_aware = TOOL_RESPONSES.replace("'\\n</tool_response>' }}", "'\\n</tool_response>' + ('' if loop.last else '\\n') }}")
    assert last_aware != TOOL_RESPONSES
    model = build_chat_model(tmp_path / "m", "hermes", template=HERMES.replace(TOOL_RESPONSES, last_aware))
    with open_engine(tmp_path / "c", model) as eng:
        r = eng.generate(QUESTION, session="s", system=SYSTEM, **{**LOOP, "max_steps": 3})
    steps = walk(r)
    for (p0, t0, _), (p1, _, stats) in zip(steps[1:], steps[2:]):  # from step 3 on: the last result rewritten
        kept = next(i for i, (a, b) in enumerate(zip(p0 + t0, p1)) if a != b)  # up to the first changed token
        assert len(p1) - kept <= stats["prefilled_tokens"] <= len(p1) - kept + 1
        assert stats["prefilled_tokens"] > len(p1) - len(p0) - len(t0)
        assert stats["prefill_note"] == "the template re-rendered what followed a reply of turn 1 (a tool result, its glue)"


def test_a_tools_exception_goes_back_to_the_model_and_a_declined_call_never_runs(chat_model, tmp_path, log):
    def broken(city: Literal["oslo"]) -> str:
        """Always fails.

        Args:
            city: A city
        """
        raise RuntimeError(f"no data for {city}")

    asked = []
    with open_engine(tmp_path / "c", chat_model("hermes")) as eng:
        r = eng.generate(QUESTION, tools=[broken], tool_choice="required", max_steps=1, max_tokens=200)
        assert r.steps[0].error.startswith("RuntimeError: no data for") and r.steps[0].result is None
        assert "Error: RuntimeError" in eng.models.get("m").tokenizer.decode(r.prompt_tokens)
        r = eng.generate(QUESTION, tools=TOOLS, tool_choice="required", max_steps=2, max_tokens=300,
                         confirm=lambda call: asked.append(call.name) or False)
        assert len(asked) == 2 and all(s.error == "the user declined this call" for s in r.steps)
        assert not log.exists()  # nothing ran
        r = eng.generate(QUESTION, tools=TOOLS, tool_choice="none", max_tokens=8)  # offered, never called
        assert r.steps == [] and r.stats["steps"] == 0


def test_bad_tool_requests_are_one_line_errors(chat_model, tiny_model_dir, tmp_path):
    with open_engine(tmp_path / "c", chat_model("hermes")) as eng:
        for kw, match in ((dict(tools=[print]), "docstring"), (dict(tools=TOOLS, tool_choice="always"), "tool_choice"),
                          (dict(tool_choice="required"), "go with tools"),
                          (dict(tools=TOOLS, regex="a+"), "tool_choice='none'")):
            with pytest.raises(ToolError, match=match):
                eng.generate(QUESTION, **kw)
        eng.load_model(tiny_model_dir, name="chatml")
        with pytest.raises(ToolError, match="no tool-call format"):
            eng.generate(QUESTION, model="chatml", tools=TOOLS)


def test_an_interrupt_leaves_the_session_as_it_was_and_the_rerun_runs_no_tool_twice(chat_model, tmp_path, log,
                                                                                    monkeypatch):
    with open_engine(tmp_path / "c", chat_model("hermes")) as eng:
        eng.generate("Hello", session="s", max_tokens=4)
        before = [dict(m) for m in eng.sessions.get("s").messages]

        def interrupt_at_third(step):
            if len(log.read_text().splitlines()) == 3:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            eng.generate(QUESTION, session="s", on_step=interrupt_at_third, **LOOP)
        assert eng.sessions.get("s").messages == before
        rerun = eng.generate(QUESTION, session="s", **LOOP)
        assert len(log.read_text().splitlines()) == 6  # 3 before the interrupt, 3 after: none twice
        assert [s.stats.get("replayed", False) for s in rerun.steps] == [True] * 3 + [False] * 3
    with open_engine(tmp_path / "d", chat_model("hermes")) as eng:  # uninterrupted, elsewhere
        eng.generate("Hello", session="s", max_tokens=4)
        whole = eng.generate(QUESTION, session="s", **LOOP)
    assert summary(rerun) | {"replayed": 0} == summary(whole)


def test_kill_9_during_a_tool_and_the_rerun_continues_after_the_last_completed_step(chat_model, tmp_path):
    def run(cache_dir, log, kill_at):
        proc = subprocess.run([sys.executable, str(SUPPORT / "agent_tools.py"), str(cache_dir), str(chat_model("hermes")),
                               str(log), str(kill_at)], capture_output=True, text=True, timeout=600)
        return proc.returncode, json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr

    code, _ = run(tmp_path / "c", tmp_path / "killed.log", 4)
    assert code == -9 and len((tmp_path / "killed.log").read_text().splitlines()) == 4  # killed in the 4th tool
    code, resumed = run(tmp_path / "c", tmp_path / "killed.log", 0)
    assert code == 0, resumed
    assert resumed["replayed"] == 3 and len((tmp_path / "killed.log").read_text().splitlines()) == 4 + 3
    code, whole = run(tmp_path / "w", tmp_path / "whole.log", 0)
    assert code == 0 and {**resumed, "replayed": 0} == whole
