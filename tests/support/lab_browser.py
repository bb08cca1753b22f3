"""Real JupyterLab in Debian's headless Chromium (driven by playwright-python through its executable
path; no browser download), for the browser tests: `lab_server(tmp, work, env)` starts JupyterLab on
loopback with private settings, `Browser(lab, notebook, tag)` opens a notebook in it (screenshots of
failures under artifacts/), `notebook(...)` writes one.

Needs `scripts/install_browser_deps.sh` (apt `chromium`; pip `playwright`, `jupyterlab`); `requirements()`
says what is missing (the tests skip with that reason).
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
from contextlib import contextmanager
from pathlib import Path

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


def requirements() -> str | None:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cell(src: str) -> dict:
    return {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": src}


def notebook(path: Path, cells: list, kernel: str, display: str) -> Path:
    nb = {
        "cells": [cell(c) for c in cells],
        "metadata": {
            "kernelspec": {"name": kernel, "display_name": display, "language": "python"},
            "language_info": {"name": "python"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path.write_text(json.dumps(nb, indent=1))
    return path


def install_mlxcache_kernelspec(data_dir: Path) -> str | None:
    """The mlxcache kernelspec under a private JUPYTER_PATH entry; None if unavailable."""
    try:
        from mlxcache_kernel.kernelspec import write_kernel_spec
    except ImportError:
        return None
    write_kernel_spec(data_dir / "kernels" / "mlxcache")
    return "mlxcache"



@contextmanager
def lab_server(tmp_path: Path, work: Path, env_extra: dict):
    """JupyterLab serving `work`, with the mlxcache kernelspec and `env_extra` (the kernels' settings)."""
    token = "mlxcache-test-" + os.urandom(8).hex()
    port = free_port()
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
    # every cell attached and rendered: JupyterLab 4's default ("contentVisibility") skips rendering cells
    # scrolled out of view, and their outputs' innerText then reads as "" (a CI run saw a dashboard's rows empty)
    notebook_settings = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / "@jupyterlab" / "notebook-extension"
    notebook_settings.mkdir(parents=True)
    (notebook_settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    data_dir = tmp_path / "jupyter_data"
    kernel = install_mlxcache_kernelspec(data_dir)
    env["JUPYTER_PATH"] = os.pathsep.join([str(data_dir), *filter(None, [env.get("JUPYTER_PATH")])])
    env.update(env_extra)
    log_path = tmp_path / "jupyter.log"
    log = open(log_path, "wb")
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
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError("jupyter lab exited:\n" + log_path.read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("jupyter lab did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.5)
        yield {"base": base, "token": token, "tmp": tmp_path, "log": log_path, "mlxcache_kernel": kernel}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def wait_kernel_ready(lab, notebook: str, timeout_s: float = 90) -> dict:
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


def counter(page, name: str) -> int:
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
            self.kernel = wait_kernel_ready(self.lab, self.notebook)
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


