"""A real browser: JupyterLab + headless Chromium (Debian's `chromium`, driven
by playwright-python through its executable path) open a small notebook, run
it on the venv's kernel, and check that the residency dashboard renders and
its numbers change. The screenshot is kept under artifacts/.

Needs `scripts/install_browser_deps.sh` (apt `chromium`; pip `playwright`,
`jupyterlab`); skipped with the reason when they are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
DOC_IMAGES = ROOT / "docs" / "images"  # the README's screenshots: MLXCACHE_UPDATE_README_IMAGES=1 refreshes them
CHROMIUM = os.environ.get("MLXCACHE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
SERVER_TIMEOUT_S = 90
CELL_TIMEOUT_MS = 120_000
PAGE_TIMEOUT_MS = 90_000


def _requirements() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"chromium not installed ({CHROMIUM}); run scripts/install_browser_deps.sh"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright-python not installed; run scripts/install_browser_deps.sh"
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        return "jupyterlab not installed; run scripts/install_browser_deps.sh"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cell(src: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": src}


def _notebook(path: Path, cells: list, kernel: str, display: str) -> Path:
    nb = {
        "cells": [_cell(c) for c in cells],
        "metadata": {
            "kernelspec": {"name": kernel, "display_name": display, "language": "python"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))
    return path


PROMPT = "the quick brown fox jumps over the lazy dog " * 6


def make_api_notebook(workdir: Path, model: Path) -> Path:
    """Python API on the stock ipykernel: the dashboard, generations that miss,
    write, evict and hit, a progress bar, the KV inspector."""
    cells = [
        "import sys, time\n"
        "from mlxcache_kernel.engine import Engine\n"
        "from mlxcache_kernel.widgets import ResidencyDashboard, GenerationProgress, KVInspector\n"
        f"eng = Engine(cache_dir={str(workdir / 'cache-api')!r}, ram_budget_bytes=400_000, prefill_chunk=64)\n"
        f"eng.load_model({str(model)!r})\n"
        "dash = ResidencyDashboard(eng)\n"
        "dash",
        "for i in range(4):\n"
        f"    eng.generate(f'Prompt {{i}}: ' + {PROMPT!r}, max_tokens=8)\n"
        "eng.flush(); eng.poll()",
        "from IPython.display import display\n"
        "p = GenerationProgress(); display(p)\n"
        f"r = eng.generate('Prompt 3: ' + {PROMPT!r} + 'again', max_tokens=8, on_progress=p.update)\n"
        "p.finish(); eng.flush(); eng.poll()\n"
        "print('DONE', dash.counters['ram_hits'] + dash.counters['ssd_hits'], dash.counters['misses'])",
        "KVInspector(eng)",
    ]
    return _notebook(workdir / "dashboard_api.ipynb", cells, "python3", "Python 3 (ipykernel)")


def make_magics_notebook(workdir: Path, model: Path) -> Path:
    """The mlxcache kernel's own magics: %dashboard, %%generate (progress bar
    then footer), %kv inspect --widget."""
    cells = [
        f"%model load {model}",
        "%dashboard",
        f"%%generate -n 8\nPrompt A: {PROMPT * 3}",
        f"%%generate -n 8\nPrompt A: {PROMPT * 3} and once more",
        "%kv inspect --widget",
        "%%generate -n 4\nPrompt B: {undefined_thing}",
        "%cache ls",
        "%mlxcache",
        "%%generate?",
        "print('DONE')",
    ]
    return _notebook(workdir / "dashboard_magics.ipynb", cells, "mlxcache", "MLX Cache (Python 3)")


def _install_mlxcache_kernelspec(data_dir: Path) -> str | None:
    """The mlxcache kernelspec under a private JUPYTER_PATH entry; None if unavailable."""
    try:
        from mlxcache_kernel.kernelspec import write_kernel_spec
    except ImportError:
        return None
    write_kernel_spec(data_dir / "kernels" / "mlxcache")
    return "mlxcache"


@pytest.fixture(scope="module")
def jupyter_lab(tmp_path_factory):
    reason = _requirements()
    if reason:
        pytest.skip(reason)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from tiny_model import build_tiny_model

    tmp_path = tmp_path_factory.mktemp("lab")
    token = "mlxcache-test-" + os.urandom(8).hex()
    port = _free_port()
    env = dict(os.environ)
    for k in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR"):
        env.pop(k, None)
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "jupyter_config")
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "jupyter_runtime")
    env["JUPYTERLAB_SETTINGS_DIR"] = str(tmp_path / "lab_settings")
    env["JUPYTERLAB_WORKSPACES_DIR"] = str(tmp_path / "lab_workspaces")
    # no news/update pop-ups over the notebook
    news = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    work = tmp_path / "work"
    work.mkdir()
    model = build_tiny_model(tmp_path / "tiny-model")
    make_api_notebook(work, model)
    make_magics_notebook(work, model)
    data_dir = tmp_path / "jupyter_data"
    kernel = _install_mlxcache_kernelspec(data_dir)
    env["JUPYTER_PATH"] = os.pathsep.join([str(data_dir), *filter(None, [env.get("JUPYTER_PATH")])])
    # the mlxcache kernel's engine: private cache, a small RAM budget, short prefill chunks
    env.update(
        MLXCACHE_CACHE_DIR=str(tmp_path / "cache-magics"), MLXCACHE_RAM_BUDGET="4MB",
        MLXCACHE_PREFILL_CHUNK="64", MLXCACHE_DEFAULT_MODEL="none",
    )
    log = open(tmp_path / "jupyter.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser", f"--IdentityProvider.token={token}", f"--port={port}",
            "--ip=127.0.0.1", f"--ServerApp.root_dir={work}", "--ServerApp.port_retries=0",
            *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []),
            "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            log.close()
            pytest.fail("jupyter lab exited:\n" + (tmp_path / "jupyter.log").read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("jupyter lab did not start:\n" + (tmp_path / "jupyter.log").read_text()[-3000:])
        time.sleep(0.5)
    try:
        yield {"base": base, "token": token, "tmp": tmp_path, "log": tmp_path / "jupyter.log", "mlxcache_kernel": kernel}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def _wait_kernel_ready(lab, notebook: str, timeout_s: float = 90) -> dict:
    """Wait until the notebook's kernel is idle with the page's websocket attached."""
    deadline = time.monotonic() + timeout_s
    sessions = []
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{lab['base']}/api/sessions?token={lab['token']}", timeout=5) as r:
            sessions = json.load(r)
        for sess in sessions:
            k = sess.get("kernel") or {}
            if sess.get("path", "").endswith(notebook) and k.get("execution_state") == "idle" and k.get("connections", 0) >= 1:
                time.sleep(0.5)
                return k
        time.sleep(0.5)
    raise AssertionError(f"the kernel of {notebook} did not become ready: {sessions}")


def _counter(page, name: str) -> int:
    v = page.get_attribute(f".mlxc-dashboard .mlxc-counter[data-name='{name}']", "data-value")
    return int(float(v)) if v not in (None, "", "None") else 0


class Browser:
    """Headless Chromium on one notebook; screenshots on failure."""

    def __init__(self, lab, notebook: str, tag: str):
        self.lab, self.notebook, self.tag = lab, notebook, tag
        self.console: list[str] = []

    def __enter__(self):
        from playwright.sync_api import sync_playwright

        ARTIFACTS.mkdir(exist_ok=True)
        # LD_PRELOAD (OpenBLAS for the kernel) breaks threads in node and
        # Chromium's helper processes: keep it for the kernel, not the browser.
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        saved = os.environ.pop("LD_PRELOAD", None)
        try:
            self._pw_cm = sync_playwright()
            pw = self._pw_cm.__enter__()  # the node driver starts now, without LD_PRELOAD
        finally:
            if saved is not None:
                os.environ["LD_PRELOAD"] = saved
        try:
            self.ctx = pw.chromium.launch_persistent_context(
                str(self.lab["tmp"] / f"chromium-profile-{self.tag}"),
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, env=env, timeout=60_000,
                viewport={"width": 1400, "height": 1600},
            )
        except Exception:
            self._pw_cm.__exit__(None, None, None)
            raise
        page = self.page = self.ctx.pages[0] if self.ctx.pages else self.ctx.new_page()
        page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}"))
        try:
            # reset=: a fresh workspace, so only this notebook is open
            page.goto(
                f"{self.lab['base']}/lab/tree/{self.notebook}?reset&token={self.lab['token']}", timeout=PAGE_TIMEOUT_MS
            )
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=PAGE_TIMEOUT_MS)
            # the page's own indicator says idle before the websocket is attached
            self.kernel = _wait_kernel_ready(self.lab, self.notebook)
            page.click(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell >> nth=0")
            page.keyboard.press("Escape")
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def run_cells(self, n: int) -> None:
        for _ in range(n):
            self.page.keyboard.press("Shift+Enter")

    def wait_output(self, text: str, timeout: int = CELL_TIMEOUT_MS) -> None:
        self.page.wait_for_function(
            "(t) => [...document.querySelectorAll('.jp-OutputArea-output')].some(e => e.textContent.includes(t))",
            arg=text, timeout=timeout,
        )

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc is not None:
                try:
                    self.page.screenshot(path=str(ARTIFACTS / f"browser_failure_{self.tag}.png"), full_page=True)
                except Exception:
                    pass
        finally:
            self.ctx.close()
            self._pw_cm.__exit__(None, None, None)
        if exc is not None and not isinstance(exc, AssertionError):
            log = self.lab["log"].read_text(errors="replace")[-3000:]
            raise AssertionError(
                f"{type(exc).__name__}: {exc}\n--- browser console ---\n" + "\n".join(self.console[-30:])
                + f"\n--- jupyter log ---\n{log}\n(screenshot: artifacts/browser_failure_{self.tag}.png)"
            ) from exc
        return False


def test_dashboard_renders_and_updates_in_jupyterlab(jupyter_lab):
    """Python API on the stock ipykernel."""
    shot = ARTIFACTS / "browser_dashboard.png"
    with Browser(jupyter_lab, "dashboard_api.ipynb", "api") as b:
        page = b.page
        # cell 1: the dashboard renders, with no activity yet
        b.run_cells(1)
        page.wait_for_selector(".mlxc-dashboard .mlxc-counter[data-name='misses']", timeout=CELL_TIMEOUT_MS)
        assert _counter(page, "misses") == 0
        assert _counter(page, "ram_hits") == 0
        ram_before = page.inner_text(".mlxc-dashboard .mlxc-ram")
        assert "0 B of" in ram_before
        assert page.locator(".mlxc-dashboard .mlxc-ram-bar").count() == 1

        # the rest: generations miss, write, evict, then hit
        b.run_cells(3)
        b.wait_output("DONE")
        page.wait_for_function(
            "() => { const e = document.querySelector(\".mlxc-dashboard .mlxc-counter[data-name='misses']\");"
            " return e && Number(e.dataset.value) >= 1; }",
            timeout=30_000,
        )
        page.wait_for_selector(".mlxc-kv-inspector .mlxc-kv-heatmap", timeout=CELL_TIMEOUT_MS)
        page.wait_for_timeout(1500)  # the throttled full refresh after the last events
        misses = _counter(page, "misses")
        hits = _counter(page, "ram_hits") + _counter(page, "ssd_hits")
        written = _counter(page, "bytes_written")
        rows = page.locator(".mlxc-dashboard tr.mlxc-entry").count()
        ram_after = page.inner_text(".mlxc-dashboard .mlxc-ram")
        log_rows = page.locator(".mlxc-dashboard tr.mlxc-log-row").count()
        progress_visible = page.locator(".mlxc-progress:visible").count()
        page.screenshot(path=str(shot), full_page=True)
        page.locator(".mlxc-dashboard").screenshot(path=str(ARTIFACTS / "browser_dashboard_widget.png"))
        page.locator(".mlxc-kv-inspector").screenshot(path=str(ARTIFACTS / "browser_kv_inspector.png"))
        heatmaps = page.locator(".mlxc-kv-inspector .mlxc-kv-heatmap").count()
        console = list(b.console)

    assert misses >= 1, (misses, console[-20:])
    assert hits >= 1
    assert written > 0
    assert rows >= 1
    assert log_rows >= 1  # evictions/demotions under a 400 KB budget
    assert ram_after != ram_before
    assert progress_visible == 0  # finish() removed the bar
    assert shot.exists() and shot.stat().st_size > 10_000
    assert heatmaps == 2  # keys and values of layer 0
    assert not [c for c in console if c.startswith("error")], console


def test_magics_dashboard_in_mlxcache_kernel(jupyter_lab):
    """%dashboard, %%generate and %kv inspect --widget on the mlxcache kernel."""
    if not jupyter_lab["mlxcache_kernel"]:
        pytest.skip("mlxcache_kernel.kernelspec is not available")
    with Browser(jupyter_lab, "dashboard_magics.ipynb", "magics") as b:
        page = b.page
        b.run_cells(2)  # %model load, %dashboard
        page.wait_for_selector(".mlxc-dashboard .mlxc-counter[data-name='misses']", timeout=CELL_TIMEOUT_MS)
        assert _counter(page, "misses") == 0
        b.run_cells(8)
        b.wait_output("DONE")
        page.wait_for_selector(".mlxc-kv-inspector .mlxc-kv-heatmap", timeout=CELL_TIMEOUT_MS)
        page.wait_for_timeout(1500)
        misses = _counter(page, "misses")
        hits = _counter(page, "ram_hits") + _counter(page, "ssd_hits")
        rows = page.locator(".mlxc-dashboard tr.mlxc-entry").count()
        progress_visible = page.locator(".mlxc-progress:visible").count()
        bars = page.evaluate(BAR_JS)
        texts = page.evaluate("() => [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.innerText)")
        previews = page.evaluate(
            "() => [...document.querySelectorAll('.mlxc-dashboard td.mlxc-preview')].map(e => e.innerText)")
        page.screenshot(path=str(ARTIFACTS / "browser_magics.png"), full_page=True)
        page.locator(".mlxc-dashboard").screenshot(path=str(ARTIFACTS / "browser_magics_dashboard.png"))
        page.locator(".mlxc-dashboard").screenshot(path=str(ARTIFACTS / "dashboard.png"))
        page.locator(".mlxc-footer").nth(1).screenshot(path=str(ARTIFACTS / "footer-bar.png"))
        console = list(b.console)
    check_footer_bars(bars)
    full = "\n".join(texts)
    # help, the cheat sheet, the undefined-name warning and %cache ls, as a notebook user sees them
    assert "Examples:" in full and "%%generate --checkpoint-every 32" in full, full[-3000:]
    assert "mlxcache: a resident model" in full and "%cache stats | ls [--all]" in full
    assert "{undefined_thing} is not defined and sent as written" in full and "{{undefined_thing}}" in full
    assert previews and all(p.startswith("Prompt ") for p in previews), previews  # no "user" role marker
    for name in ("dashboard.png", "footer-bar.png"):
        assert 2_000 < (ARTIFACTS / name).stat().st_size < 300_000, name
        if os.environ.get("MLXCACHE_UPDATE_README_IMAGES"):  # the README's copies change only when asked
            DOC_IMAGES.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ARTIFACTS / name, DOC_IMAGES / name)
    assert misses >= 1 and hits >= 1, (misses, hits)
    assert rows >= 1
    assert progress_visible == 0  # replaced by the footer
    assert not [c for c in console if c.startswith("error")], console


# each footer bar: its spans' rendered widths (fractions of the bar) and token counts
BAR_JS = """() => [...document.querySelectorAll('.mlxc-footer-bar')].map(bar => {
  const total = bar.getBoundingClientRect().width;
  return {width: total, spans: [...bar.querySelectorAll('.mlxc-span')].map(s => ({
    kind: s.className.replace('mlxc-span mlxc-span-', ''), tokens: Number(s.dataset.tokens),
    frac: s.getBoundingClientRect().width / total}))};
})"""


def check_footer_bars(bars: list) -> None:
    """One bar per generation, its spans drawn in proportion to their token counts."""
    assert len(bars) == 3, bars
    for bar in bars:
        assert bar["width"] > 100, bar
        n = sum(s["tokens"] for s in bar["spans"])
        for s in bar["spans"]:
            assert abs(s["frac"] - s["tokens"] / n) < 0.02, bar
    assert [s["kind"] for s in bars[0]["spans"]] == ["prefilled"]  # the first prompt: cold
    kinds = [s["kind"] for s in bars[1]["spans"]]
    assert kinds == ["ram", "prefilled"] and bars[1]["spans"][0]["frac"] > 0.8, bars[1]  # its prefix from RAM
