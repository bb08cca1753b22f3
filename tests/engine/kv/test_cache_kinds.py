"""Every mlx-lm cache kind, on tiny random-weight models of real architectures
(tests/support/tiny_archs.py): a cache hit continues exactly like a cold run.

For each architecture: cold == RAM hit == SSD restore in a new process ==
kill -9 resume, token for token, greedy and seeded; for a prompt that
extends a cached long prompt by one token, a branch off it, a rerun, and
hits while the SSD writes are still queued. Published checkpoints never
change after publication.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from catalog_view import inflight_records
from holds import wait_ready
from tiny_archs import ARCHS, build_arch_model

from mlxcache_kernel.engine import Engine, SamplingParams
from mlxcache_kernel.engine.cache.ssd import writer as writer_mod
from repo_paths import SUPPORT


def ids(n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 259, n)]


P = ids(180, 1)  # wraps a window of 32 many times
P1 = P + ids(1, 2)  # extends P by exactly one token
BRANCH = P[:150] + ids(30, 3)  # shares 150 tokens with P, then differs
MODES = {
    "greedy": SamplingParams(max_tokens=12),
    "seeded": SamplingParams(max_tokens=12, temperature=0.8, seed=3),
}
SEQUENCE = [("P", P), ("P1", P1), ("BRANCH", BRANCH), ("P", P)]
TESTS = str(SUPPORT)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_model(request, tmp_path_factory):
    arch = request.param
    return arch, build_arch_model(arch, tmp_path_factory.mktemp(arch) / "model")


@pytest.fixture(scope="module")
def cold(arch_model, tmp_path_factory):
    """Cold runs of every prompt and mode, with no cache at all."""
    _, path = arch_model
    with Engine(cache_dir=tmp_path_factory.mktemp("ref"), ssd=False) as ref:
        ref.load_model(path, name="m")
        return {
            (name, mode): ref.generate_tokens(prompt, params=params, use_cache=False).tokens
            for mode, params in MODES.items()
            for name, prompt in SEQUENCE
        }


def digest(cp) -> str:
    h = hashlib.sha256()
    for a in cp.arrays():
        h.update(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).tobytes())
    return h.hexdigest()


class Immutability:
    """Remembers every published checkpoint's bytes; `check()` finds any that changed."""

    def __init__(self, eng: Engine):
        self.eng, self.seen = eng, {}

    def check(self) -> None:
        for e in self.eng.cache.entries():
            d = digest(e.checkpoint)
            assert self.seen.setdefault(id(e.checkpoint), (e.checkpoint, d))[1] == d, f"{len(e.tokens)}-token entry changed"


@pytest.fixture
def held_writes(monkeypatch):
    """SSD writes wait at a gate until released (the real writer and files, just later)."""
    gate = threading.Event()
    real = writer_mod.fmt.write_checkpoint

    def gated(*a, **kw):
        gate.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(writer_mod.fmt, "write_checkpoint", gated)
    yield gate
    gate.set()


def test_hits_continue_like_cold_runs(arch_model, cold, tmp_path, held_writes):
    arch, path = arch_model
    eng = Engine(cache_dir=tmp_path / "c")
    eng.load_model(path, name="m")
    watch = Immutability(eng)
    for mode, params in MODES.items():
        if mode == "seeded":  # the greedy pass ran with every write still queued
            assert eng.stats()["pending_writes"] > 0 and eng.stats()["writes_committed"] == 0
            held_writes.set()
        for name, prompt in SEQUENCE:
            r = eng.generate_tokens(prompt, params=params)
            assert r.tokens == cold[(name, mode)], f"{arch} {mode} {name}: {r.stats['cache_source']}"
            watch.check()
        # the prompt that extends P by one token, and the rerun, reuse (nearly) all of P
        assert eng.generate_tokens(P1, params=params).stats["cached_tokens"] >= len(P) - 1
        assert eng.generate_tokens(P, params=params).stats["cached_tokens"] == len(P) - 1
        watch.check()
    report = eng.flush(timeout=60)
    assert not report["failed"] and report["pending"] == 0
    assert eng.cache_verify() == []
    eng.close()


def test_logits_after_a_hit_match_cold(arch_model, tmp_path):
    _, path = arch_model
    eng = Engine(cache_dir=tmp_path / "c", ssd=False)
    eng.load_model(path, name="m")
    m = eng.models.get()
    eng.generate_tokens(P, max_tokens=4)
    lease = eng.cache.take(P1, m.namespace)
    assert lease is not None and lease.length >= len(P) - 1

    def last_logits(caches, start):
        if P1[start:-1]:
            m.model(mx.array(P1[start:-1])[None], cache=caches)
        return m.model(mx.array(P1[-1:])[None], cache=caches)[0, -1]

    hit = last_logits(lease.caches, lease.length)
    ref = last_logits(m.new_caches(), 0)
    assert hit.dtype == mx.float32 and np.allclose(np.array(hit), np.array(ref), atol=1e-5)
    lease.release()
    eng.close()


RESTORE_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from mlxcache_kernel.engine import Engine, SamplingParams
eng = Engine(cache_dir={cache!r}, prefetch_budget_bytes=0)  # the first lookup reads the file itself
eng.load_model({model!r}, name="m")
out = {{}}
for mode, params in {modes!r}.items():
    for name, prompt in {sequence!r}:
        r = eng.generate_tokens(prompt, **params)
        out.setdefault(mode, []).append([name, r.tokens, r.stats["cache_source"], r.stats["cached_tokens"]])
print(json.dumps(out))
"""


def test_ssd_restore_in_a_new_process(arch_model, cold, tmp_path):
    arch, path = arch_model
    cache = tmp_path / "c"
    with Engine(cache_dir=cache) as eng:
        eng.load_model(path, name="m")
        for mode, params in MODES.items():
            eng.generate_tokens(P, params=params)
    sequence = [("P1", P1), ("P", P)]
    modes = {mode: p.as_dict() for mode, p in MODES.items()}
    script = RESTORE_SCRIPT.format(tests=TESTS, cache=str(cache), model=str(path), modes=modes, sequence=sequence)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    name, tokens, source, cached = runs["greedy"][0]  # the first lookup in the new process
    assert source == "ssd" and cached >= len(P) - 1, f"{arch}: {source} {cached}"
    for mode, results in runs.items():
        for name, tokens, source, cached in results:
            assert tokens == cold[(name, mode)], f"{arch} {mode} {name} from {source}"


KILL_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from holds import hold_at_inflight
from mlxcache_kernel.engine import Engine, SamplingParams
eng = Engine(cache_dir={cache!r})
eng.load_model({model!r}, name="m")
hold_at_inflight(eng, {cache!r}, {kill_at!r}, {ready!r})
eng.generate_tokens({prompt!r}, **{params!r}, checkpoint_every=3)
print("finished", flush=True)
"""
KILL_AT = 9  # emitted tokens the in-flight record holds when the child is killed (checkpoint_every=3)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_kill9_resume_is_exact(arch_model, tmp_path, mode):
    """The child holds (tests/support/holds.py) once a record of KILL_AT tokens is durable; then SIGKILL."""
    arch, path = arch_model
    params = SamplingParams(**{**MODES[mode].as_dict(), "max_tokens": 64, "stop": ()})
    with Engine(cache_dir=tmp_path / "ref", ssd=False) as ref:
        ref.load_model(path, name="m")
        expected = ref.generate_tokens(P, params=params, use_cache=False).tokens
    assert len(expected) > KILL_AT, f"{arch} {mode}: the run ends (eos) after {len(expected)} tokens, before the kill"
    cache, ready = tmp_path / "c", tmp_path / "ready"
    script = KILL_SCRIPT.format(tests=TESTS, cache=str(cache), model=str(path), prompt=P, params=params.as_dict(),
                                kill_at=KILL_AT, ready=str(ready))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        held = wait_ready(ready, lambda: None if proc.poll() is None else proc.communicate()[1][-3000:])
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    [record] = inflight_records(cache)
    emitted = len(record["emitted"])
    assert emitted == held["emitted"] == KILL_AT, arch
    with Engine(cache_dir=cache) as eng:
        eng.load_model(path, name="m")
        r = eng.generate_tokens(P, params=params, checkpoint_every=3)
        assert r.stats["resumed_from"] == emitted, arch
        assert r.tokens == expected, arch
        assert not inflight_records(cache)
