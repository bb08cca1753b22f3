"""@memo and %memo: notebook functions' array results on the cache's tiers (issue 21)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from magics_shell import engine, run, usage_error

from mlxcache_kernel import memo
from mlxcache_kernel.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def eng(tmp_path):
    with Engine(cache_dir=tmp_path / "cache") as e:
        yield e


def test_a_hit_does_not_run_the_function(eng):
    calls = []

    @memo(engine=eng)
    def embed(x, n=2, *, scale=1.0):
        calls.append((x.tolist() if hasattr(x, "tolist") else x, n, scale))
        return {"e": mx.array(np.asarray(x, np.float32)) * n * scale, "n": np.arange(n)}

    first = embed(np.arange(3))
    for same in (embed(np.arange(3)), embed(np.arange(3), 2), embed(x=np.arange(3), n=2, scale=1.0)):
        assert mx.array_equal(same["e"], first["e"]).item() and same["n"].tolist() == [0, 1]
    assert len(calls) == 1
    embed(np.arange(3, dtype=np.int32))  # another dtype
    embed(np.arange(3).reshape(1, 3))  # another shape
    embed(np.array([0, 1, 3]))  # other bytes
    embed(mx.arange(3))  # another kind
    embed(np.arange(3), n=3)
    embed(np.arange(3), scale=1)  # an int, not a float
    assert len(calls) == 7
    embed(np.arange(3), scale=1)
    assert len(calls) == 7 and embed.engine() is eng and eng.stats()["object_ram_hits"] >= 4


def test_version_and_source_are_part_of_the_key(eng):
    calls = []

    def make(version, body):
        ns = {"memo": memo, "mx": mx, "calls": calls, "eng": eng}
        exec(f"@memo(version={version!r}, engine=eng)\ndef f(x):\n    calls.append(1)\n    return {body}\n", ns)
        return ns["f"]

    assert make(None, "mx.ones(2) * x")(3).tolist() == [3, 3]
    assert make(None, "mx.ones(2) * x")(3).tolist() == [3, 3] and len(calls) == 1  # the same code: a hit
    assert make(2, "mx.ones(2) * x")(3).tolist() == [3, 3] and len(calls) == 2  # another version
    assert make(None, "mx.ones(2) * x + 1")(3).tolist() == [4, 4] and len(calls) == 3  # other code


def test_unsupported_arguments_say_to_pass_key(eng):
    class Model:
        name = "tiny"

    @memo(engine=eng)
    def encode(model, x):
        return mx.array([x])

    with pytest.raises(TypeError) as e:
        encode(Model(), 1)
    assert "argument 'model' is of type " in str(e.value) and "Pass key=" in str(e.value)
    assert "@memo(key=lambda model, x: (...))" in str(e.value)
    with pytest.raises(TypeError, match=r"argument 'x'\[1\]\['k'\] is of type set"):
        encode(1, (0, {"k": {1}}))
    calls = []

    @memo(key=lambda model, x: (model.name, x), engine=eng)
    def encode2(model, x):
        calls.append(1)
        return mx.array([x])

    assert encode2(Model(), 5).item() == 5 and encode2(Model(), 5).item() == 5 and len(calls) == 1

    @memo(key=lambda model, x: model, engine=eng)
    def encode3(model, x):
        return mx.array([x])

    with pytest.raises(TypeError, match="key=.*returned a key"):
        encode3(Model(), 1)
    with pytest.raises(TypeError, match="version"):
        memo(version=1.5)
    with pytest.raises(TypeError, match="encode2.*missing"):
        encode2()


def test_results_memo_cannot_store_are_returned_uncached(eng):
    calls = []

    @memo(engine=eng)
    def odd(x):
        calls.append(1)
        return {"set": {x}}

    with pytest.warns(UserWarning, match="odd's result is not cached"):
        assert odd(1) == {"set": {1}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per function
        assert odd(1) == {"set": {1}}
    assert len(calls) == 2

    @memo(engine=eng)
    def fails(x):
        calls.append(1)
        raise RuntimeError("boom")

    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            fails(1)
    assert len(calls) == 4 and eng.stats()["object_puts"] == 0


def test_clear_forgets_one_function(eng):
    @memo(engine=eng)
    def a(x):
        return mx.array([x])

    @memo(engine=eng)
    def b(x):
        return mx.array([x])

    a(1), a(2), b(1)
    eng.flush()
    assert a.clear() == 2 and a.clear() == 0
    assert [r["label"] for r in eng.objects.entries()] == [b.label] and b.label.endswith("b")


SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import mlx.core as mx, numpy as np
    from mlxcache_kernel import memo

    @memo
    def features(seed, n=1 << 20):
        print("ran", flush=True)
        x = mx.random.normal((n // 4,), key=mx.random.key(seed))
        return {"x": x, "stats": (np.float64(x.sum().item()), int(n)), "np": np.asarray(x)[:10].astype(np.float64)}

    r = features(3)
    print(json.dumps({"x": hashlib.sha256(np.asarray(r["x"]).tobytes()).hexdigest(), "stats": repr(r["stats"]),
                      "np": r["np"].tolist(), "dtype": str(r["x"].dtype)}))
""")


def test_memo_survives_a_restart_and_recomputes_after_corruption(tmp_path):
    """Outside IPython: the default engine on $MLXCACHE_CACHE_DIR; a new process is a hit from SSD."""
    script = tmp_path / "feat.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MLXCACHE_CACHE_DIR": str(tmp_path / "cache")}
    for var in ("MLXCACHE_SSD", "MLXCACHE_WRITE_BEHIND", "MLXCACHE_RAM_BUDGET"):
        env.pop(var, None)

    def once():
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                             check=True).stdout.splitlines()
        return out[0] == "ran", json.loads(out[-1])

    ran, first = once()
    assert ran
    ran, second = once()
    assert not ran and second == first
    files = list((tmp_path / "cache" / "checkpoints").glob("obj-*/*.ckpt"))
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 1
    files[0].write_bytes(bytes(data))
    ran, third = once()
    assert ran and third == first  # a miss: it ran again, and stored the result again
    ran, fourth = once()
    assert not ran and fourth == first


# --- %memo in IPython ---


def test_memo_magics(ip, capsys):
    assert "no memoized results" in run(ip, capsys, "%memo ls")[1]
    res, out, _ = run(ip, capsys, textwrap.dedent("""
        import mlx.core as mx
        from mlxcache_kernel import memo
        ran = []
        @memo
        def square(x):
            ran.append(x)
            return mx.array([x * x])
        @memo
        def cube(x):
            return mx.array([x ** 3])
        print(square(3).item(), square(3).item(), square(4).item(), cube(2).item(), len(ran))
        """))
    assert res.success and out.split() == ["9", "9", "16", "8", "2"]
    assert engine(ip).objects.where(ip.user_ns["square"].key(3)) == "ram"  # the kernel's engine
    res, out, _ = run(ip, capsys, "%memo ls")
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["function", "results", "in_ram", "on_ssd"]
    assert lines[2].split()[:2] in (["cube", "1"], ["square", "2"]) and len(lines) == 4
    res, out, _ = run(ip, capsys, "%cache ls")
    assert "square" in out and "object" in out
    assert "no memoized results of 'nope'" in usage_error(ip, capsys, "%memo clear nope")
    assert "needs a function name" in usage_error(ip, capsys, "%memo clear")
    assert "takes no name" in usage_error(ip, capsys, "%memo ls square")
    res, out, _ = run(ip, capsys, "%memo clear square")
    assert "forgot 2 memoized results of 'square'" in out
    assert run(ip, capsys, "print(square(3).item(), len(ran))")[1].split() == ["9", "3"]  # ran again
    res, out, _ = run(ip, capsys, "%memo clear --all")
    assert "forgot 2 memoized results of every function" in out
    for name in ("square", "cube", "ran", "memo", "mx"):
        ip.user_ns.pop(name, None)


KERNEL_CELL = """
import hashlib, mlx.core as mx, numpy as np
from mlxcache_kernel import memo
ran = 0

@memo
def feats(seed):
    global ran
    ran += 1
    return mx.random.normal((256, 64), key=mx.random.key(seed)).astype(mx.bfloat16), np.arange(seed)

a, b = feats(7)
print(ran, a.dtype, a.shape, hashlib.sha256(np.asarray(a.view(mx.uint16))).hexdigest(), b.tolist(), b.flags.writeable)
"""


def test_memoized_results_survive_a_kernel_restart(start_kernel):
    """Through the real kernel: after a restart the same cell is a hit from SSD, identical, without running."""
    k = start_kernel()
    first = k.execute(KERNEL_CELL)
    assert first["status"] == "ok", first
    ran, *result = first["stream"].split(maxsplit=1)
    assert ran == "1" and "bfloat16" in result[0]
    k.restart()
    second = k.execute(KERNEL_CELL)
    assert second["status"] == "ok", second
    ran2, *result2 = second["stream"].split(maxsplit=1)
    assert ran2 == "0" and result2 == [result[0].replace("True", "False")]  # numpy results are read-only on a hit
    res = k.execute("from mlxcache_kernel import get_engine; s = get_engine().stats(); "
                    "print(s['object_ssd_hits'], s['object_ram_entries'])")
    assert res["stream"].split() == ["1", "1"]
    assert "feats" in k.execute("%memo ls")["text"]
