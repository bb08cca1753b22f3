"""kill -9 during a constrained, checkpointed generation: a real child process answers under a JSON
Schema with checkpoint_every, holds (tests/support/holds.py) once an in-flight record is durable, and
is killed with SIGKILL; a new engine on the same directory resumes it, its grammar rebuilt from the
emitted tokens, to exactly the uninterrupted answer. A request without the schema (or with another)
is another request: it does not resume the constrained one's record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from catalog_view import inflight_records
from holds import wait_ready
from tiny_model import build_tiny_model

from mlxcache_kernel.engine import Engine
from repo_paths import SUPPORT

PROMPT = "Write one long word in a record."
SCHEMA = {"type": "object", "x-guidance": {"whitespace_flexible": False}, "additionalProperties": False,
          "properties": {"word": {"type": "string", "minLength": 30, "maxLength": 30}}, "required": ["word"]}
EVERY, KILL_AT = 5, 10
CASES = {"seeded": dict(max_tokens=120, temperature=0.8, seed=7), "greedy-drafted": dict(max_tokens=120)}

KILL_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from holds import hold_at_inflight
from mlxcache_kernel.engine import Engine
eng = Engine(cache_dir={cache!r}, prefetch_budget_bytes=0)
eng.load_model({model!r}, name="m")
eng.load_model({model!r}, name="twin")
hold_at_inflight(eng, {cache!r}, {kill_at!r}, {ready!r})
eng.generate({prompt!r}, response_format={schema!r}, checkpoint_every={every!r}, **{options!r})
print("finished", flush=True)
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("constrained_resume") / "m")


@pytest.mark.parametrize("case", sorted(CASES))
def test_kill9_mid_answer_resumes_to_the_uninterrupted_answer(model, tmp_path, case):
    options = dict(CASES[case], **({"draft": "twin", "num_draft_tokens": 3} if "drafted" in case else {}))
    with Engine(cache_dir=tmp_path / "ref", ssd=False) as ref:
        ref.load_model(model, name="m")
        expected = ref.generate(PROMPT, use_cache=False, response_format=SCHEMA, **CASES[case])
    assert expected.stats["finish_reason"] == "eos" and len(expected.tokens) > KILL_AT + EVERY
    cache, ready = tmp_path / "c", tmp_path / "ready"
    script = KILL_SCRIPT.format(tests=str(SUPPORT), cache=str(cache), model=str(model), kill_at=KILL_AT,
                                ready=str(ready), prompt=PROMPT, schema=SCHEMA, every=EVERY, options=options)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_ready(ready, lambda: None if proc.poll() is None else proc.communicate()[1][-3000:])
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    [record] = inflight_records(cache)
    assert record["emitted"] == expected.tokens[:KILL_AT]

    with Engine(cache_dir=cache, prefetch_budget_bytes=0) as eng:
        eng.load_model(model, name="m")
        eng.load_model(model, name="twin")
        free = eng.generate(PROMPT, checkpoint_every=EVERY, max_tokens=4)  # another request: no resume
        assert free.stats["resumed_from"] is None and len(inflight_records(cache)) == 1
        r = eng.generate(PROMPT, response_format=SCHEMA, checkpoint_every=EVERY, **options)
        assert r.stats["resumed_from"] == KILL_AT and r.stats["cache_source"] == "ssd"
        assert r.tokens == expected.tokens and r.text == expected.text and r.parsed == expected.parsed
        assert len(r.parsed["word"]) == 30 and not inflight_records(cache)
