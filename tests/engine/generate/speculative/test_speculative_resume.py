"""kill -9 during a checkpointed speculative generation (issue 31): a real child process decodes with
a draft and checkpoint_every, holds (tests/support/holds.py) once an in-flight record is durable, and
is killed with SIGKILL; a new engine on the same directory resumes it with the draft, to exactly the
tokens of plain decoding. A draft that agrees with everything (the target's own weights) makes every
round span K tokens, so the rounds must end at each boundary (sync_at) for the capture to be exact.
Drafts from the context (lookup=True, no draft model) the same way: a tiny random model repeats itself,
so its rounds are long too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from catalog_view import inflight_records
from holds import wait_ready
from tiny_model import build_tiny_model
from tiny_archs import build_arch_model

from mlxcache_kernel.engine import Engine, SamplingParams
from repo_paths import SUPPORT

PROMPT = "A long shared document about harbours, ships and the weather near the coast. Tell me more."
EVERY, KILL_AT = 5, 10  # not a multiple of K: a round is cut short at a boundary
PARAMS = {"greedy": dict(max_tokens=40), "seeded": dict(max_tokens=40, temperature=0.8, seed=7)}

KILL_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from holds import hold_at_inflight
from mlxcache_kernel.engine import Engine, SamplingParams
eng = Engine(cache_dir={cache!r}, prefetch_budget_bytes=0)
eng.load_model({target!r}, name="m")
if {draft!r}:
    eng.load_model({draft!r}, name="d")
hold_at_inflight(eng, {cache!r}, {kill_at!r}, {ready!r})
eng.generate({prompt!r}, model="m", checkpoint_every={every!r}, **{params!r}, **{drafts!r})
print("finished", flush=True)
"""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_resume")
    return {"twin": build_tiny_model(root / "target", seed=0), "small": build_tiny_model(root / "other", seed=1),
            "lookup": build_arch_model("llama", root / "repeats", scale=1.5)}  # low spread: repeats itself


@pytest.mark.parametrize("mode", sorted(PARAMS))
@pytest.mark.parametrize("draft", ["twin", "small", "lookup"])
def test_kill9_during_a_speculative_generation_resumes_to_identical_tokens(dirs, tmp_path, draft, mode):
    sampling = PARAMS[mode]
    drafts = dict(lookup=True) if draft == "lookup" else dict(draft="d", num_draft_tokens=3)
    target = dirs["lookup" if draft == "lookup" else "twin"]
    with Engine(cache_dir=tmp_path / "ref", ssd=False) as ref:
        ref.load_model(target, name="m")
        expected = ref.generate(PROMPT, use_cache=False, **sampling).tokens
    assert len(expected) > KILL_AT + EVERY, f"the run ends (eos) after {len(expected)} tokens, before the kill"
    cache, ready = tmp_path / "c", tmp_path / "ready"
    script = KILL_SCRIPT.format(tests=str(SUPPORT), cache=str(cache), target=str(target),
                                draft=str(dirs[draft]) if draft != "lookup" else "", drafts=drafts, kill_at=KILL_AT, ready=str(ready), prompt=PROMPT,
                                every=EVERY, params=sampling)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        held = wait_ready(ready, lambda: None if proc.poll() is None else proc.communicate()[1][-3000:])
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    [record] = inflight_records(cache)
    assert len(record["emitted"]) == held["emitted"] == KILL_AT
    assert record["emitted"] == expected[:KILL_AT]  # the killed run had emitted plain decoding's tokens

    with Engine(cache_dir=cache, prefetch_budget_bytes=0) as eng:
        eng.load_model(target, name="m")
        if draft != "lookup":
            eng.load_model(dirs[draft], name="d")
        r = eng.generate(PROMPT, model="m", checkpoint_every=EVERY, **sampling, **drafts)
        assert r.stats["resumed_from"] == KILL_AT and r.stats["cache_source"] == "ssd"
        assert r.tokens == expected
        if draft == "lookup":
            assert r.stats["lookup_drafts_accepted"] > 0
        else:
            assert r.stats["draft_fallback"] is None and r.stats["draft_tokens_proposed"] > 0
        if draft == "twin":
            assert r.stats["draft_tokens_accepted"] == r.stats["draft_tokens_proposed"]
        assert not inflight_records(cache), "completion removes the resume record"
        again = eng.generate(PROMPT, model="m", **sampling, **drafts)  # a new request
        assert again.stats["resumed_from"] is None and again.tokens == expected
