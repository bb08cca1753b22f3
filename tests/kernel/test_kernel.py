"""The kernelspec and a real MLXCacheKernel process driven through jupyter_client."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from holds import install_code, wait_ready
from kernel_client import Kernel, counts, footer, generated_text, inflight_progress

from mlxcache_kernel import kernelspec


# --- kernelspec ---


def test_kernelspec_install(tmp_path):
    from jupyter_client.kernelspec import KernelSpecManager

    dest = kernelspec.install(prefix=str(tmp_path))
    assert Path(dest) == tmp_path / "share" / "jupyter" / "kernels" / "mlxcache"
    spec = json.loads((Path(dest) / "kernel.json").read_text())
    assert spec["argv"] == [sys.executable, "-m", "mlxcache_kernel", "-f", "{connection_file}"]
    assert spec["display_name"] == "MLX Cache (Python 3)"
    assert spec["language"] == "python"
    from mlxcache_kernel.engine.host.blas import openblas_path

    if openblas_path():
        assert spec["env"]["LD_PRELOAD"].split(":")[0] == openblas_path()
    assert "PATH" not in spec.get("env", {})  # not a copy of this shell's environment
    assert (Path(dest) / "logo-64x64.png").exists()
    found = KernelSpecManager(kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")]).get_kernel_spec("mlxcache")
    assert found.display_name == "MLX Cache (Python 3)"
    kernelspec.install(prefix=str(tmp_path))  # reinstall replaces
    with pytest.raises(ValueError):
        kernelspec.install(user=True, prefix=str(tmp_path))


def test_cli_install(tmp_path, capsys):
    from mlxcache_kernel.cli import main

    assert main(["install", "--prefix", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mlxcache" in out and str(tmp_path) in out
    assert (tmp_path / "share" / "jupyter" / "kernels" / "mlxcache" / "kernel.json").exists()
    with pytest.raises(SystemExit):
        main(["install", "--user", "--prefix", str(tmp_path)])


# --- a running kernel ---


def test_kernel_info_magics_and_errors(start_kernel):
    k = start_kernel()
    k.kc.kernel_info()
    reply = k.kc.get_shell_msg(timeout=30)["content"]
    assert reply["implementation"] == "mlxcache_kernel"
    assert reply["language_info"]["name"] == "python"
    assert "MLX Cache kernel" in reply["banner"]
    res = k.execute("%load_ext mlxcache_kernel\nimport sys; print('blas' , sys.platform)")
    assert res["status"] == "ok"
    res = k.execute("%model load /definitely/not/here")
    assert res["status"] == "error" and res["error"][0] == "UsageError"
    assert "does not exist" in res["error"][1] and "\n" not in res["error"][1]
    res = k.execute("%%generate --max-tokens 4\nhello kernel")
    assert res["status"] == "ok" and "loading the default model" in res["stream"]
    assert counts(footer(res))["ram"] == 0
    res = k.execute("%%generate --max-tokens 4 --out r\nhello kernel")
    c = counts(footer(res))
    assert c["ram"] == c["prompt"] - 1 and c["prefilled"] == 1
    res = k.execute("print(type(r).__name__, len(r.tokens), r.stats['cache_source'])")
    assert res["stream"].strip() == "CellResult 4 ram"
    res = k.execute("from mlxcache_kernel.engine.host.blas import active_blas; print(active_blas())")
    from mlxcache_kernel.engine.host.blas import openblas_path

    if openblas_path():
        assert res["stream"].startswith("openblas")


def test_restart_resume_identical_from_ssd(start_kernel):
    k = start_kernel()
    greedy = "%%generate --max-tokens 24\nWrite a haiku about caches."
    seeded = "%%generate --max-tokens 24 --temperature 0.9 --seed 11\nWrite a limerick about SSDs."
    g1, s1 = k.execute(greedy), k.execute(seeded)
    assert g1["status"] == s1["status"] == "ok"
    msgs = k.restart()
    assert any(
        m["msg_type"] == "stream" and "[mlxcache] before restart" in m["content"]["text"] for m in msgs
    ), [m["msg_type"] for m in msgs]
    g2, s2 = k.execute(greedy), k.execute(seeded)
    assert generated_text(g2) == generated_text(g1) and generated_text(g2)
    assert generated_text(s2) == generated_text(s1)
    # from SSD: read by the lookup, or prefetched into RAM when the model loaded
    c = counts(footer(g2))
    assert c["ram"] + c["ssd"] == c["prompt"] - 1 and c["prefilled"] == 1
    c = counts(footer(s2))
    assert c["ram"] + c["ssd"] == c["prompt"] - 1
    assert "[mlxcache] before restart" in k.log.read_text()


def test_shutdown_flushes_pending_writes(start_kernel):
    """With write-behind off nothing is written until shutdown, which must flush (and say so)."""
    k = start_kernel(MLXCACHE_WRITE_BEHIND="0")
    cell = "%%generate --max-tokens 16\nPersist me at shutdown."
    first = k.execute(cell)
    res = k.execute("from mlxcache_kernel import get_engine; s = get_engine().stats(); "
                    "print(s['ssd_files'], s['dirty_entries'])")
    files, dirty = map(int, res["stream"].split())
    assert files == 0 and dirty >= 1
    k.km.request_shutdown(restart=False)
    msgs = k.drain_iopub(1.0)
    k.km.finish_shutdown()
    texts = [m["content"]["text"] for m in msgs if m["msg_type"] == "stream"]
    assert any("[mlxcache] before shutdown: flushed" in t for t in texts), texts
    assert "[mlxcache] before shutdown: flushed" in k.log.read_text()
    k2 = start_kernel(MLXCACHE_WRITE_BEHIND="0")
    again = k2.execute(cell)
    assert generated_text(again) == generated_text(first)
    c = counts(footer(again))
    assert c["ram"] + c["ssd"] == c["prompt"] - 1  # read back from SSD (or prefetched into RAM)


def test_interrupt_then_resume_exactly(start_kernel, endless_model_dir, tmp_path):
    """An interrupted --checkpoint-every generation resumes, in the same kernel, to the uninterrupted text.
    The interrupt comes while the generation holds (tests/support/holds.py) with a record of 64 tokens committed."""
    k = start_kernel()
    cache, ready = Path(k.env["MLXCACHE_CACHE_DIR"]), tmp_path / "ready"
    assert k.execute(f"%model load {endless_model_dir} --name endless")["status"] == "ok"
    cell = "%%generate --model endless --max-tokens 300 --checkpoint-every 16 --out r\nA very long story"
    show = "import json; print(json.dumps(r.tokens)); print(r.stats['resumed_from'])"
    assert k.execute(cell)["status"] == "ok"
    expected = json.loads(k.execute(show)["stream"].splitlines()[0])
    assert len(expected) == 300

    assert k.execute(install_code("hold_at_inflight", cache, 64, ready))["status"] == "ok"
    msg_id = k.kc.execute(cell)
    reached = wait_ready(ready, lambda: k.cell_ended(msg_id))["emitted"]
    assert reached == 64 == inflight_progress(cache)
    reply = k.interrupt(msg_id)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"

    res = k.execute(cell)
    assert res["status"] == "ok"
    m = re.search(r"resumed from an in-flight checkpoint at token (\d+)", footer(res))
    assert m and int(m.group(1)) == reached, footer(res)
    lines = k.execute(show)["stream"].splitlines()
    assert json.loads(lines[0]) == expected and int(lines[1]) == reached
    assert k.execute("%cache stats")["status"] == "ok"


def test_interrupt_without_checkpoints_keeps_the_prompt(start_kernel, endless_model_dir, tmp_path):
    """The interrupt comes while the generation holds (tests/support/holds.py) after 100 characters of text."""
    k = start_kernel()
    ready = tmp_path / "ready"
    assert k.execute(f"%model load {endless_model_dir} --name endless")["status"] == "ok"
    assert k.execute(install_code("hold_after_text", 100, ready))["status"] == "ok"
    cell = "%%generate --model endless --max-tokens 3000\nAnother long story"
    msg_id = k.kc.execute(cell)
    assert wait_ready(ready, lambda: k.cell_ended(msg_id))["chars"] >= 100
    assert k.interrupt(msg_id)["ename"] == "KeyboardInterrupt"
    res = k.execute(cell.replace("3000", "4"))
    assert res["status"] == "ok" and counts(footer(res))["ram"] > 0  # the prompt state was published


def test_extension_in_the_stock_ipython_kernel(kernel_env, tmp_path):
    """`%load_ext mlxcache_kernel` gives the same magics in ipykernel's own kernel."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    log = open(tmp_path / "stock.log", "ab")
    km.start_kernel(env=kernel_env, stderr=log)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        outs = {}

        def execute(code):
            res = {"results": [], "stream": "", "stderr": ""}

            def hook(msg):
                t, c = msg["msg_type"], msg["content"]
                if t == "execute_result":
                    res["results"].append(c["data"].get("text/plain", ""))
                elif t == "stream":
                    res["stream" if c["name"] == "stdout" else "stderr"] += c["text"]

            reply = kc.execute_interactive(code, output_hook=hook, timeout=120)
            res["status"] = reply["content"]["status"]
            res["ename"] = reply["content"].get("ename")
            return res

        assert execute("%load_ext mlxcache_kernel")["status"] == "ok"
        first = execute("%%generate --max-tokens 6\nfrom the stock kernel")
        assert first["status"] == "ok" and counts(footer(first))["prefilled"] == counts(footer(first))["prompt"]
        second = execute("%%generate --max-tokens 6\nfrom the stock kernel")
        assert counts(footer(second))["ram"] == counts(footer(second))["prompt"] - 1
        bad = execute("%session show ghost")
        assert bad["status"] == "error" and bad["ename"] == "UsageError"
        outs["ok"] = execute("%unload_ext mlxcache_kernel")
        assert outs["ok"]["status"] == "ok"
        assert execute("%cache stats")["status"] == "error"  # the magics are gone
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
        log.close()
