"""Every example notebook, executed headless with nbclient against the installed kernelspec,
plus a kill -9 during a checkpointed generation followed by an exact resume.

The notebooks load "the configured default model" (`%model load`), so the
same files run on the tiny random model here (fast, every CI run) and on
SmolLM2-135M-Instruct in the tests marked `smollm`.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest


from holds import install_code, wait_ready  # noqa: E402
from kernel_client import Kernel, counts, footer, inflight_progress  # noqa: E402

from mlxcache_kernel.runner import cell_outputs_text, execute_notebook  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
NOTEBOOKS = ["quickstart.ipynb", "restart_resume.ipynb", "long_document.ipynb", "chat_session.ipynb"]
FOOTER = re.compile(r"\[mlxcache\] (\d+) prompt tokens: (\d+) from RAM, (\d+) from SSD, (\d+) prefilled")


@pytest.fixture(scope="module")
def ksm(spec_prefix):
    from jupyter_client.kernelspec import KernelSpecManager

    return KernelSpecManager(kernel_dirs=[str(spec_prefix / "share" / "jupyter" / "kernels")])


def run_example(name: str, ksm, env: dict):
    nb = execute_notebook(EXAMPLES / name, kernel_spec_manager=ksm, env=env, timeout=900)
    return nb, [cell_outputs_text(c) if c.cell_type == "code" else "" for c in nb.cells]


def footers(texts) -> list[dict]:
    out = []
    for t in texts:
        for m in FOOTER.finditer(t):
            out.append(dict(zip(("prompt", "ram", "ssd", "prefilled"), map(int, m.groups()))))
    return out


def check_errors(nb):
    """Only cells tagged raises-exception may show an error, and then a one-line UsageError."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        text = cell_outputs_text(cell)
        if "raises-exception" in cell.metadata.get("tags", []):
            assert "UsageError: " in text and "Traceback" not in text, text
        else:
            assert not errors and "Traceback" not in text and "UsageError" not in text, (cell.source, text)


def check_notebook(name: str, nb, texts) -> None:
    check_errors(nb)
    full = "\n".join(texts)
    fs = footers(texts)
    if name == "quickstart.ipynb":
        assert "identical text: True" in full
        assert fs[0]["prompt"] > 150  # the notes were interpolated
        assert fs[1]["ram"] == fs[1]["prompt"] - 1 and fs[1]["prefilled"] == 1
        assert "pending_writes" in full and "ram+ssd" in full
        assert re.search(r"second run: TTFT \d+ ms \(\d+ of \d+ prompt tokens from RAM\)", full), full
    elif name == "restart_resume.ipynb":
        restarted = [c for c in nb.cells if c.metadata.get("mlxcache", {}).get("restart_s") is not None]
        assert len(restarted) == 1
        assert "greedy identical:  True" in full and "sampled identical: True" in full
        assert re.search(r"restored from: (ssd|ram)", full), full  # read now, or prefetched when the model loaded
        after = fs[2:4]
        assert all(f["ssd"] + f["ram"] == f["prompt"] - 1 for f in after), fs
    elif name == "long_document.ipynb":
        assert "q3 identical with and without the cache: True" in full
        q1, q2, q3, cold = fs
        assert q2["ram"] > 0.9 * q2["prompt"] and q3["ram"] > 0.9 * q3["prompt"]
        assert cold["prefilled"] == cold["prompt"]
    elif name == "chat_session.ipynb":
        assert "checkpoint 'tide-chat' saved" in full and "checkpoint 'tide-chat' restored" in full
        assert "[user] Why would it need a backup sensor?" in full
        assert fs[1]["ram"] >= fs[0]["prompt"] // 2 and fs[2]["ram"] > 0
        assert "'layer0.keys'" in full
        assert any(
            "application/vnd.jupyter.widget-view+json" in o.get("data", {})
            for c in nb.cells if c.cell_type == "code" and c.source.strip() == "%dashboard"
            for o in c.outputs
        )


def test_examples_are_generated_from_the_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_examples", ROOT / "scripts" / "make_examples.py")
    make_examples = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_examples)
    assert make_examples.main(["--check"]) == 0, "examples/ differs from scripts/make_examples.py"
    import nbformat

    for name in NOTEBOOKS:
        nb = nbformat.read(EXAMPLES / name, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "mlxcache"


def test_readme_pictures_exist_and_are_small():
    """The README shows the dashboard and a footer bar, saved by tests/kernel/test_browser.py."""
    readme = (ROOT / "README.md").read_text()
    pictures = re.findall(r"!\[[^\]]*\]\((docs/images/[\w.-]+\.png)\)", readme)
    assert {"docs/images/dashboard.png", "docs/images/footer-bar.png"} <= set(pictures), pictures
    for rel in pictures:
        data = (ROOT / rel).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000, rel


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_example_on_tiny_model(name, ksm, tiny_model_dir, tmp_path):
    env = {**os.environ, "MLXCACHE_CACHE_DIR": str(tmp_path / "cache"),
           "MLXCACHE_DEFAULT_MODEL": str(tiny_model_dir), "MLXCACHE_RAM_BUDGET": "256MiB"}
    nb, texts = run_example(name, ksm, env)
    check_notebook(name, nb, texts)


def test_quickstart_labels_each_run_by_where_its_prompt_came_from(ksm, tiny_model_dir, tmp_path):
    """Run twice on one cache directory: the second time the first generation comes from SSD (or RAM, prefetched
    from SSD when the model loaded), not 'cold'."""
    env = {**os.environ, "MLXCACHE_CACHE_DIR": str(tmp_path / "cache"),
           "MLXCACHE_DEFAULT_MODEL": str(tiny_model_dir), "MLXCACHE_RAM_BUDGET": "256MiB"}
    first = "\n".join(run_example("quickstart.ipynb", ksm, env)[1])
    assert re.search(r"first run: TTFT \d+ ms \(cold: all \d+ prompt tokens prefilled\)", first), first
    again = "\n".join(run_example("quickstart.ipynb", ksm, env)[1])
    assert re.search(r"first run: TTFT \d+ ms \(\d+ of \d+ prompt tokens from (SSD|RAM)\)", again), again
    assert "cold" not in again.split("identical text:", 1)[1].split("\n\n", 1)[0]


@pytest.mark.smollm
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_example_on_smollm2(name, ksm, default_model_dir, tmp_path):
    env = {**os.environ, "MLXCACHE_CACHE_DIR": str(tmp_path / "cache"), "MLXCACHE_DEFAULT_MODEL": "smollm2"}
    nb, texts = run_example(name, ksm, env)
    check_notebook(name, nb, texts)
    full = "\n".join(texts)
    assert "SmolLM2" in full  # %model load reports the converted model's path


# --- kill -9 during a checkpointed generation, then exact resume ---


def kill9_and_resume(spec_prefix: Path, model_dir, tmp_path: Path, *, sampling: str, max_tokens: int, every: int,
                     kill_after: int, prompt: str) -> None:
    """Reference run; then a run killed with SIGKILL while it holds (tests/support/holds.py) with an in-flight
    record of kill_after tokens committed; then the identical cell in a fresh kernel must resume and match.
    kill_after is a multiple of `every`: no interval is skipped before a hold."""
    cell = (f"%%generate --model m --max-tokens {max_tokens} --checkpoint-every {every}{sampling} --out r\n{prompt}")
    show = "import json; print(json.dumps(r.tokens)); print(r.stats['resumed_from'])"
    base_env = {**os.environ, "MLXCACHE_DEFAULT_MODEL": "none", "MLXCACHE_RAM_BUDGET": "1GiB"}
    load = f"%model load {model_dir} --name m"

    def start(cache: Path, log: str) -> Kernel:
        k = Kernel(spec_prefix, {**base_env, "MLXCACHE_CACHE_DIR": str(cache)}, tmp_path / log)
        assert k.execute(load)["status"] == "ok"
        return k

    ref = start(tmp_path / "ref-cache", "ref.log")  # the uninterrupted run, in its own cache
    try:
        assert ref.execute(cell)["status"] == "ok"
        expected = json.loads(ref.execute(show)["stream"].splitlines()[0])
    finally:
        ref.shutdown()
    assert len(expected) > kill_after + every, f"the run ends (eos) after {len(expected)} tokens, before the kill"

    cache, ready = tmp_path / "cache", tmp_path / "ready"
    victim = start(cache, "victim.log")
    try:
        assert victim.execute(install_code("hold_at_inflight", cache, kill_after, ready))["status"] == "ok"
        msg_id = victim.kc.execute(cell)
        reached = wait_ready(ready, lambda: victim.cell_ended(msg_id))["emitted"]
        victim.kill9()
    finally:
        victim.shutdown()
    assert reached == kill_after and inflight_progress(cache) == reached

    again = start(cache, "again.log")
    try:
        res = again.execute(cell)
        assert res["status"] == "ok"
        f = footer(res)
        m = re.search(r"resumed from an in-flight checkpoint at token (\d+)", f)
        assert m and int(m.group(1)) == reached, f
        lines = again.execute(show)["stream"].splitlines()
        assert json.loads(lines[0]) == expected
        assert int(lines[1]) == reached
        # the resume point is spent: the same cell again is an ordinary cache hit, not a resume
        res2 = again.execute(cell)
        assert "resumed from" not in footer(res2) and counts(footer(res2))["ram"] > 0
    finally:
        again.shutdown()


@pytest.mark.parametrize("sampling", ["", " --temperature 0.6 --top-k 40 --seed 9"], ids=["greedy", "seeded"])
def test_kill9_during_checkpointed_generation_resumes_exactly(sampling, spec_prefix, endless_model_dir, tmp_path):
    kill9_and_resume(spec_prefix, endless_model_dir, tmp_path, sampling=sampling, max_tokens=1000, every=16,
                     kill_after=96, prompt="Tell a very long story about a lighthouse keeper.")


@pytest.mark.smollm
def test_kill9_resume_on_smollm2(spec_prefix, default_model_dir, tmp_path):
    kill9_and_resume(spec_prefix, default_model_dir, tmp_path, sampling=" --temperature 0.7 --seed 3",
                     max_tokens=64, every=8, kill_after=16,
                     prompt="Write a long, detailed story about a lighthouse keeper and a storm.")


def test_cli_run_prints_the_notebook(spec_prefix, tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`mlxcache-kernel run examples/quickstart.ipynb` (the README's main command), on the tiny model."""
    from mlxcache_kernel.cli import main

    monkeypatch.setenv("JUPYTER_PATH", str(spec_prefix / "share" / "jupyter"))
    monkeypatch.setenv("MLXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLXCACHE_DEFAULT_MODEL", str(tiny_model_dir))
    out_nb = tmp_path / "executed.ipynb"
    assert main(["run", str(EXAMPLES / "quickstart.ipynb"), "--output", str(out_nb)]) == 0
    out = capsys.readouterr().out
    assert "In [1]:\n    %model load" in out and "identical text: True" in out
    assert out.count("[mlxcache]") >= 3 and "UsageError: unknown session 'nobody'" in out
    assert out_nb.exists() and "quickstart.ipynb: " in out
    assert main(["run", str(tmp_path / "missing.ipynb")]) == 1
    assert "no such notebook" in capsys.readouterr().err


def test_cli_run_allow_errors_runs_past_a_failing_cell(spec_prefix, tmp_path, monkeypatch, capsys):
    """`mlxcache-kernel run NB --allow-errors`: every cell runs, each error printed in place."""
    import nbformat

    from mlxcache_kernel.cli import main

    monkeypatch.setenv("JUPYTER_PATH", str(spec_prefix / "share" / "jupyter"))
    monkeypatch.setenv("MLXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in (
        "print('first cell ran')", "x = 1\n1 / 0", "%session show nobody", "print('last cell ran')")])
    nb.metadata["kernelspec"] = {"name": "mlxcache", "display_name": "MLX Cache", "language": "python"}
    path = tmp_path / "failing.ipynb"
    nbformat.write(nb, path)
    assert main(["run", str(path), "--allow-errors"]) == 0
    out = capsys.readouterr().out
    order = [out.find(s) for s in ("first cell ran", "ZeroDivisionError", "division by zero",
                                   "UsageError: unknown session 'nobody'", "last cell ran")]
    assert -1 not in order and order == sorted(order), out
    assert "1 / 0" in out.split("ZeroDivisionError", 1)[1]  # the traceback, under its cell
    assert "4 code cells" in out and "2 raised an error" in out
    # without the flag the run stops at the first failing cell
    assert main(["run", str(path)]) == 1
    captured = capsys.readouterr()
    assert "first cell ran" in captured.out and "last cell ran" not in captured.out
    assert "ZeroDivisionError" in captured.err


def test_cli_lab_serves_the_kernelspec(tmp_path):
    """`mlxcache-kernel lab` installs the kernelspec and starts JupyterLab, which can start the kernel."""
    import importlib.util
    import json as json_module
    import socket
    import subprocess
    import urllib.request

    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("JupyterLab is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "MLXCACHE_CACHE_DIR": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "mlxcache_kernel.cli", "lab", "--prefix", str(tmp_path / "prefix"), "--no-browser",
           "--port", str(port), "--ip", "127.0.0.1", "--", "--IdentityProvider.token=t0k", "--allow-root",
           f"--ServerApp.root_dir={tmp_path}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def api(path, method="GET"):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                     headers={"Authorization": "token t0k"}, data=b"{}" if method == "POST" else None)
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
            return json_module.loads(body) if body else None

    try:
        specs, deadline = None, time.monotonic() + 90
        while specs is None and time.monotonic() < deadline:
            try:
                specs = api("/api/kernelspecs")
            except OSError:
                time.sleep(0.5)
        assert specs is not None, proc.stdout.read1().decode() if proc.stdout else ""
        spec = specs["kernelspecs"]["mlxcache"]["spec"]
        assert spec["display_name"] == "MLX Cache (Python 3)"
        assert spec["argv"][1:3] == ["-m", "mlxcache_kernel"]
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/kernels", method="POST",
                                     headers={"Authorization": "token t0k", "Content-Type": "application/json"},
                                     data=json_module.dumps({"name": "mlxcache"}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            kernel = json_module.loads(r.read())
        assert kernel["name"] == "mlxcache"
        code = "from mlxcache_kernel.engine.host.blas import active_blas; print(active_blas())\n%cache config"
        out = asyncio.run(_execute_over_websocket(port, "t0k", kernel["id"], code))
        assert f"cache_dir: {tmp_path / 'cache'}" in out
        from mlxcache_kernel.engine.host.blas import openblas_path

        if openblas_path():
            assert out.startswith("openblas:")
        api(f"/api/kernels/{kernel['id']}", method="DELETE")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _execute_over_websocket(port: int, token: str, kernel_id: str, code: str, timeout: float = 120) -> str:
    """Run code in a server-managed kernel the way JupyterLab does (websocket); return its stdout."""
    import json as json_module
    import uuid

    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(HTTPRequest(f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels",
                                             headers={"Authorization": f"token {token}"}))
    msg_id, session = uuid.uuid4().hex, uuid.uuid4().hex
    header = {"msg_id": msg_id, "msg_type": "execute_request", "username": "test", "session": session,
              "version": "5.3", "date": ""}
    content = {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False}
    ws.write_message(json_module.dumps({"header": header, "parent_header": {}, "metadata": {}, "content": content,
                                        "channel": "shell", "buffers": []}))
    out, deadline = "", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            raw = await asyncio.wait_for(ws.read_message(), timeout=deadline - time.monotonic())
            if raw is None:
                break
            msg = json_module.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out += msg["content"]["text"]
            elif msg["msg_type"] == "execute_reply":
                assert msg["content"]["status"] == "ok", msg["content"]
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    finally:
        ws.close()
    return out
