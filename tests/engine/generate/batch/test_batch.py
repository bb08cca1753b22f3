"""`Engine.generate_batch` on tiny random models of every cache kind (tests/support/tiny_archs.py).

The contract: a batch served from the cache (RAM, and SSD in a new process)
gives exactly the tokens of the same batch with the cache off, greedy and
seeded; rows sharing a document prefill it once; kinds mlx-lm cannot batch
run serially, with a notice, and give the tokens of serial generation. Rows of
quantized KV batch over their shared prefixes, from the first token or from a
kv_start that rows reach in their prefill, in their decode or in a shared branch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from tiny_archs import ARCHS, build_arch_model
from tiny_model import build_tiny_model

from mlxcache_kernel.engine import Engine, GenerationError, SamplingParams
from mlxcache_kernel.engine.generate.batch.run import MIN_SHARED_TOKENS
from mlxcache_kernel.engine.kv.tokens import branch_points
from repo_paths import SUPPORT


def ids(n: int, seed: int, lo: int = 3) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(lo, 259, n)]


DOC = ids(100, 1)  # wraps a window of 32 several times
Q1, Q2, Q3 = ids(6, 2), ids(9, 3), ids(4, 4)
OTHER = [DOC[0] + 1 if DOC[0] < 258 else 3] + ids(20, 5)  # shares not even its first token with DOC
PROMPTS = [DOC + Q1, DOC + Q2, DOC + Q1 + ids(5, 6), DOC + Q3, OTHER, DOC + Q2]  # a nested branch and a repeat
MODES = {"greedy": dict(max_tokens=10), "seeded": dict(max_tokens=10, temperature=0.8, seed=3)}
BATCHABLE = sorted(a for a in ARCHS if a != "llama4")  # llama4's ChunkedKVCache: mlx-lm cannot merge it
TESTS = str(SUPPORT)


def computed_once(prompts) -> int:
    """Tokens a batch forwards when every shared prefix is prefilled once: each distinct
    prefix of the rows' prompts but their last token, and every row's last token."""
    return len({tuple(p[:n]) for p in prompts for n in range(1, len(p))}) + len(prompts)


def tokens(results) -> list:
    return [r.tokens for r in results]


# kv_start 105: DOC + Q1 reaches it in its own prefill's last position, DOC + Q2 inside it, DOC + Q3
# in its decode; the branch DOC + Q1 (under DOC + Q1 + ...) is prefilled past it; OTHER never does
KV8 = {"llama-kv8": 0, "llama-kv8@105": 105}


@pytest.fixture(scope="module", params=BATCHABLE + ["llama4", *KV8])
def arch_model(request, tmp_path_factory):
    arch = request.param
    if arch in KV8:  # 8-bit KV in groups of 32: heads of 32 dimensions
        return arch, build_tiny_model(tmp_path_factory.mktemp("kv8") / "model", hidden=128), 8
    return arch, build_arch_model(arch, tmp_path_factory.mktemp(arch) / "model"), None


WORKER = """
import json, sys
from mlxcache_kernel.engine import Engine
eng = Engine(cache_dir={cache!r}, prefetch_budget_bytes=0)  # the first lookups read the files themselves
eng.load_model({model!r}, name="m", kv_bits={kv_bits!r}, kv_group_size=32, kv_start={kv_start!r})
out = {{}}
for mode, kw in {modes!r}.items():
    out[mode] = [[r.tokens, r.stats["cache_source"], r.stats["cached_tokens"]]
                 for r in eng.generate_batch({prompts!r}, **kw)]
eng.close()
print(json.dumps(out))
"""


def test_batch_from_the_cache_is_the_batch_without_it(arch_model, tmp_path):
    arch, path, kv_bits = arch_model
    serial_kind, kv_start = arch == "llama4", KV8.get(arch)
    cache = tmp_path / "c"
    expected = {}
    with Engine(cache_dir=cache, prefetch_budget_bytes=0) as eng:
        eng.load_model(path, name="m", kv_bits=kv_bits, kv_group_size=32, kv_start=kv_start)
        notices = []
        eng.events.subscribe(lambda e: notices.append(e) if e.get("type") == "notice" else None)
        for mode, kw in MODES.items():
            off = eng.generate_batch(PROMPTS, use_cache=False, **kw)
            expected[mode] = tokens(off)
            if serial_kind:  # the same tokens as generation one prompt at a time
                serial = [eng.generate_tokens(p, params=SamplingParams(**{**kw, "seed": kw.get("seed", 0) + i}),
                                              use_cache=False).tokens for i, p in enumerate(PROMPTS)]
                assert expected[mode] == serial, arch
            before = eng.stats()["engine_prefilled_tokens"]
            cold = eng.generate_batch(PROMPTS, **kw) if mode == "greedy" else None
            if cold is not None:
                assert tokens(cold) == expected[mode], f"{arch}: cold batch"
                assert eng.stats()["engine_prefilled_tokens"] - before == computed_once(PROMPTS), arch
                mode_want = "serial" if serial_kind else "shared-prefix" if arch.startswith("llama") else "batched"
                assert {r.stats["batch_mode"] for r in cold} == {mode_want}
                shared = [r.stats["batch_shared_tokens"] for r in cold]
                assert shared[4] == 0 and min(shared[:4]) >= len(DOC), shared
            phases = set()
            warm = eng.generate_batch(PROMPTS, on_progress=lambda phase, *_: phases.add(phase), **kw)
            assert tokens(warm) == expected[mode], f"{arch} {mode}: from RAM"
            assert "decode" in phases, arch  # serial rows report their decode too
            for p, r in zip(PROMPTS, warm):
                assert (r.stats["cache_source"], r.stats["cached_tokens"], r.stats["prefilled_tokens"]) == \
                    ("ram", len(p) - 1, 1), arch
        assert bool(notices) == serial_kind and all("cannot batch" in n["message"] for n in notices), notices
        assert eng.flush(timeout=60)["pending"] == 0
    script = WORKER.format(cache=str(cache), model=str(path), kv_bits=kv_bits, kv_start=kv_start,
                           modes=MODES, prompts=PROMPTS)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    # every row's prefix from SSD; the repeated prompt from RAM, where its twin's lookup had just restored it
    assert [row[1:] for row in runs["greedy"]] == [["ssd", len(p) - 1] for p in PROMPTS[:5]] + [["ram", len(PROMPTS[5]) - 1]]
    for mode, rows in runs.items():
        assert [row[0] for row in rows] == expected[mode], f"{arch} {mode}: from SSD in a new process"


def test_branch_points_are_where_rows_part():
    a, b, c = (1, 2, 3, 4), (1, 2, 3, 5), (1, 2, 9)
    assert branch_points([a, b, c]) == [(1, 2), (1, 2, 3)]
    assert branch_points([a, a]) == [a]  # a repeated prompt is its own branch
    assert branch_points([(1, 2), (1, 2, 3)]) == [(1, 2)]  # a prefix of another
    assert branch_points([a, b, c], min_len=3) == [(1, 2, 3)]
    assert branch_points([(7,), (8,)]) == [] and branch_points([]) == []


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_arch_model("llama", tmp_path_factory.mktemp("llama") / "model")


@pytest.fixture
def eng(llama, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as e:
        e.load_model(llama, name="m")
        yield e


def test_rows_in_order_with_strings_token_ids_and_their_own_seeds(eng):
    prompts = ["What is a lighthouse?", DOC + Q1, "Tell me about keepers."]
    rs = eng.generate_batch(prompts, max_tokens=6, temperature=0.9, seed=[5, 0, 2])
    assert [r.stats["batch_index"] for r in rs] == [0, 1, 2] and all(r.stats["batch_rows"] == 3 for r in rs)
    assert rs[1].prompt_tokens == DOC + Q1 and rs[0].prompt_tokens == eng.encode_prompt(prompts[0])
    again = eng.generate_batch(prompts, max_tokens=6, temperature=0.9, seed=[5, 0, 2], use_cache=False)
    assert tokens(rs) == tokens(again)
    other = eng.generate_batch(prompts, max_tokens=6, temperature=0.9, seed=5)  # rows get 5, 6, 7
    assert other[0].tokens == rs[0].tokens and other[1].tokens != rs[1].tokens
    nucleus = dict(max_tokens=6, temperature=0.9, top_p=0.8, top_k=20, seed=1)
    assert tokens(eng.generate_batch(prompts, **nucleus)) == tokens(eng.generate_batch(prompts, use_cache=False,
                                                                                      **nucleus))
    assert eng.generate_batch([], max_tokens=4) == []


def test_bad_batches_are_clear_errors(eng):
    for prompts, message in [("one string", "a list of prompts"), (["ok", ""], "prompt 1: empty prompt"),
                             (["ok", []], "prompt 1: a prompt is a non-empty"), ([[1, 2], [3, 999999]], "prompt 1: token id 999999"),
                             ([["a"]], "prompt 0"), (["ok", b"text"], "prompt 1: bytes")]:
        with pytest.raises(GenerationError, match=message):
            eng.generate_batch(prompts, max_tokens=2)
    with pytest.raises(GenerationError, match="one seed per prompt"):
        eng.generate_batch(["a", "b"], max_tokens=2, seed=[1])
    with pytest.raises(GenerationError, match="batch_size"):
        eng.generate_batch(["a", "b"], max_tokens=2, batch_size=0)
    with pytest.raises(GenerationError, match="max_tokens"):
        eng.generate_batch(["a"], max_tokens=0)
    with pytest.raises(GenerationError, match="logprobs must be an integer from 0 to 20"):
        eng.generate_batch(["a", "b"], max_tokens=2, logprobs=64)
    assert eng.generate_batch(["still works"], max_tokens=2)[0].tokens


def test_fewer_slots_than_rows_and_rows_that_stop_early(eng, monkeypatch):
    prompts = [DOC + ids(3, 10 + i) for i in range(5)]
    kw = dict(max_tokens=12, batch_size=2)  # two rows at a time: the others join as rows finish
    full = eng.generate_batch(prompts, use_cache=False, **kw)
    assert tokens(full) == tokens(eng.generate_batch(prompts, **kw)) == tokens(eng.generate_batch(prompts, **kw))
    # a stop string takes its row out of the batch
    stop_text = full[0].text[:2]
    stopped = eng.generate_batch(prompts, use_cache=False, stop=(stop_text,), **kw)
    assert stopped[0].stats["finish_reason"] == "stop" and stopped[0].text == ""
    assert stopped[0].tokens == full[0].tokens[: len(stopped[0].tokens)]
    # so does one of the model's end tokens: kept in the tokens, not shown in the text
    end = full[1].tokens[4]
    monkeypatch.setattr(type(eng.models.get()), "eos_token_ids", property(lambda self: {2, end}))
    off = eng.generate_batch(prompts, use_cache=False, **kw)
    assert off[1].tokens == full[1].tokens[: full[1].tokens.index(end) + 1] and off[1].stats["finish_reason"] == "eos"
    assert tokens(off) == tokens(eng.generate_batch(prompts, **kw)) == tokens(eng.generate_batch(prompts, **kw))
    serial = eng.generate_tokens(prompts[1], params=SamplingParams(12), use_cache=False)
    assert serial.tokens == off[1].tokens and serial.text == off[1].text  # greedy rows agree with serial here


def test_an_interrupted_batch_keeps_what_it_computed(eng):
    prompts = [DOC + ids(4, 20 + i) for i in range(3)]

    def in_prefill(phase, done, total):
        if phase == "prefill" and done < total:
            raise KeyboardInterrupt

    eng.prefill_chunk = 16  # the shared document in several chunks: interrupted halfway through
    with pytest.raises(KeyboardInterrupt):
        eng.generate_batch(prompts, max_tokens=20, on_progress=in_prefill)
    assert eng.admin.entries() == []  # no half-prefilled prefix is published

    def interrupt(phase, done, total):
        if phase == "decode" and done >= 9:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.generate_batch(prompts, max_tokens=20, on_progress=interrupt)
    assert all(e.borrowers == 0 for e in eng.cache.entries())  # no lease outlives the batch
    rs = eng.generate_batch(prompts, max_tokens=20)
    assert all(r.stats["cached_tokens"] == len(p) - 1 for p, r in zip(prompts, rs))
    assert tokens(rs) == tokens(eng.generate_batch(prompts, max_tokens=20, use_cache=False))


def test_a_failing_callback_loses_no_finished_row(eng):
    prompts = [DOC + ids(4, 30 + i) for i in range(3)]  # all three finish at the same step

    def fail(index, result):
        raise ValueError("the notebook's callback")

    with pytest.raises(ValueError, match="callback"):
        eng.generate_batch(prompts, max_tokens=5, on_row=fail)
    assert all(e.borrowers == 0 for e in eng.cache.entries())
    rs = eng.generate_batch(prompts, max_tokens=5)
    assert [r.stats["cached_tokens"] for r in rs] == [len(p) - 1 for p in prompts]  # each row's own state
    assert tokens(rs) == tokens(eng.generate_batch(prompts, max_tokens=5, use_cache=False))


def test_progress_and_rows_as_they_finish(eng):
    seen, rows = [], []
    rs = eng.generate_batch([DOC + Q1, DOC + Q2], max_tokens=5, on_progress=lambda *a: seen.append(a),
                            on_row=lambda i, r: rows.append((i, r.tokens)))
    assert ("prefill", len(DOC), len(DOC)) in seen and seen[-1][0] == "decode" and seen[-1][2] == 10
    assert sorted(rows) == [(0, rs[0].tokens), (1, rs[1].tokens)]
    assert len(DOC) >= MIN_SHARED_TOKENS and rs[0].stats["batch_shared_tokens"] == len(DOC)


def test_rows_branch_from_a_shared_document_without_copying_it(eng, monkeypatch):
    """Rows over one document hold it once: the batch's caches keep the document's keys as one
    prefix and each row's own positions in the tails (no copy per row); each row's published state
    shares the document's buffers."""
    from mlxcache_kernel.engine.generate.batch.shared import SharedPrefixRows

    doc = ids(1000, 7)
    prompts = [doc + ids(5, 40 + i) for i in range(3)]
    held, real = [], SharedPrefixRows._decode

    def decode(wave):  # what the batch's caches hold once the rows' prompts are in
        held.append((sum(int(t.nbytes) for c in wave.layers for t in c.tails),
                     {id(p[0]) for c in wave.layers for p in c.prefixes if p is not None}))
        return real(wave)

    monkeypatch.setattr(SharedPrefixRows, "_decode", decode)
    rs = eng.generate_batch(prompts, max_tokens=4)
    assert [r.stats["batch_shared_tokens"] for r in rs] == [len(doc)] * 3
    assert {r.stats["batch_mode"] for r in rs} == {"shared-prefix"}
    entry = max(eng.cache.entries(), key=lambda e: len(e.tokens))
    doc_bytes = entry.checkpoint.kv_bytes * len(doc) // len(entry.tokens)
    [(tails, prefixes)] = held
    assert tails < doc_bytes and len(prefixes) == len(entry.checkpoint.layers), (tails, doc_bytes)  # 3 rows < 1 doc
    rows = [e for e in eng.cache.entries() if len(e.tokens) > len(doc) + 1]
    first = {id(e.checkpoint.layers[0].segments[0].buffer) for e in rows}
    assert len(rows) == 3 and len(first) == 1  # one document buffer under every row
    assert all(e.checkpoint.kv_bytes - e.checkpoint.layers[0].segments[0].nbytes * len(e.checkpoint.layers)
               < doc_bytes / 10 for e in rows)
    monkeypatch.undo()
    assert tokens(rs) == tokens(eng.generate_batch(prompts, max_tokens=4, use_cache=False))
