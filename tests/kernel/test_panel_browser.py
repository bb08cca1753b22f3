"""The MLX Cache side panel in real JupyterLab and headless Chromium: two notebooks on the MLX Cache
kernel generate on one cache directory; the panel shows both kernels and their checkpoints; a pin,
a delete and a restore into the second notebook, each checked in the catalogue and in the kernel;
updates stop while the panel is hidden. The screenshot is kept as artifacts/panel.png.

Needs what tests/kernel/test_browser.py needs, and the built panel (scripts/build_panel.sh, run by
set-up): without it the test fails, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
import urllib.request
from pathlib import Path

import pytest
from lab_browser import ARTIFACTS, CELL_TIMEOUT_MS, DOC_IMAGES, Browser, lab_server, notebook, requirements, wait_kernel_ready

pytestmark = pytest.mark.browser

TEXT = "about lighthouses, harbours and the keepers who tended them through the winter storms " * 2
RESTORED_CHECK = ("from mlxcache_kernel import get_engine\neng = get_engine(); eng.cache.loading.wait_reads(30); eng.poll()\n"
                  "print('RESTORED', sorted(n for e in eng.cache.entries() for n in e.pinned))")


def installed_panel() -> str | None:
    prefix = Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "mlxcache-panel" / "package.json"
    return None if prefix.exists() else f"the panel is not built and installed ({prefix}): run scripts/build_panel.sh"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = requirements()
    if reason:
        pytest.skip(reason)
    missing = installed_panel()
    assert missing is None, missing  # set-up builds it: a missing panel is a failure, not a skip
    from tiny_model import build_tiny_model

    tmp = tmp_path_factory.mktemp("panel-lab")
    work = tmp / "work"
    work.mkdir()
    model = build_tiny_model(tmp / "tiny-model")
    notebook(work / "one.ipynb", [f"%model load {model}", f"%%generate -n 4\nNotebook one, first: {TEXT}",
                                  f"%%generate -n 4\nNotebook one, second: {TEXT}", "%checkpoint save keep_one",
                                  "%cache flush\nprint('ONE ' + 'DONE')"], "mlxcache", "MLX Cache (Python 3)")
    notebook(work / "two.ipynb", [f"%model load {model}", f"%%generate -n 4\nNotebook two, first: {TEXT}",
                                  f"%%generate -n 4\nNotebook two, second: {TEXT}",
                                  "%cache flush\n%cache clear\nprint('TWO ' + 'DONE')", RESTORED_CHECK],
             "mlxcache", "MLX Cache (Python 3)")
    env = dict(MLXCACHE_CACHE_DIR=str(tmp / "cache"), MLXCACHE_RAM_BUDGET="64MB", MLXCACHE_DEFAULT_MODEL="none")
    with lab_server(tmp, work, env) as running:
        yield {**running, "cache": tmp / "cache"}


def api(lab, **query) -> dict:
    url = f"{lab['base']}/mlxcache/api/overview?" + "&".join(f"{k}={v}" for k, v in query.items())
    req = urllib.request.Request(url, headers={"Authorization": f"token {lab['token']}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def catalog(lab, sql: str, args: tuple = ()) -> list:
    db = sqlite3.connect(f"file:{lab['cache'] / 'checkpoints' / 'catalog.db'}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def status_says(page, text: str) -> str:
    page.wait_for_function("(t) => (document.querySelector('.mlxc-p-status') || {}).textContent?.includes(t)",
                           arg=text, timeout=CELL_TIMEOUT_MS)
    return page.inner_text(".mlxc-p-status")


def test_the_panel_over_two_notebooks(lab):
    with Browser(lab, "one.ipynb", "panel") as b:
        page = b.page
        overview_requests: list[str] = []
        page.on("request", lambda r: overview_requests.append(r.url) if "/mlxcache/api/overview" in r.url else None)
        b.run_cells(5)
        b.wait_output("ONE DONE")
        page.goto(f"{lab['base']}/lab/tree/two.ipynb?token={lab['token']}")  # one.ipynb stays open in its tab
        page.wait_for_selector(".jp-NotebookPanel:visible .jp-Cell", timeout=CELL_TIMEOUT_MS)
        wait_kernel_ready(lab, "two.ipynb")
        page.click(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell >> nth=0")
        page.keyboard.press("Escape")
        b.run_cells(4)
        b.wait_output("TWO DONE")
        kernels = {Path(v["path"]).name: int(pid) for pid, v in api(lab)["kernels"].items()}
        one, two = kernels["one.ipynb"], kernels["two.ipynb"]

        # the panel: both kernels, alive, and the checkpoints each wrote
        page.click(".jp-SideBar .lm-TabBar-tab[data-id='mlxcache-panel']")
        page.wait_for_function(
            "(pids) => pids.every(p => document.querySelector(`.mlxc-p .mlxc-p-proc[data-pid='${p}'][data-alive='true']`))",
            arg=[one, two], timeout=CELL_TIMEOUT_MS)
        page.wait_for_selector(".mlxc-p .mlxc-p-file", timeout=CELL_TIMEOUT_MS)
        files = api(lab)["page"]["files"]
        mine = {pid: [f for f in files if f["writer"]["pid"] == pid] for pid in (one, two)}
        assert len(mine[one]) >= 2 and len(mine[two]) >= 2, files
        shown = page.eval_on_selector_all(".mlxc-p .mlxc-p-file", "rows => rows.map(r => r.dataset.key)")
        assert {f["key"] for f in files} == set(shown)
        assert "one.ipynb" in page.inner_text(f".mlxc-p .mlxc-p-proc[data-pid='{one}']")
        [kept] = [f for f in mine[one] if f["pinned_by"] == ["keep_one"]]
        to_pin, to_delete = [f for f in mine[two] if not f["in_ram"]][:2]  # two's RAM was cleared

        # pin one of two's checkpoints: a named checkpoint in the catalogue
        page.click(f".mlxc-p .mlxc-p-file[data-key='{to_pin['key']}'] button[data-action='pin']")
        page.fill(".jp-Dialog input", "panel_pin")
        page.click(".jp-Dialog .jp-mod-accept")
        assert "pinned as 'panel_pin'" in status_says(page, "pinned as")
        assert catalog(lab, "SELECT namespace, key FROM pins WHERE name='panel_pin'") == [
            (to_pin["namespace"], to_pin["key"])]
        page.wait_for_selector(f".mlxc-p .mlxc-p-file[data-key='{to_pin['key']}'][data-pinned='true'] "
                               "button[data-action='unpin'][data-name='panel_pin']", timeout=CELL_TIMEOUT_MS)
        held = page.inner_text(f".mlxc-p .mlxc-p-file[data-key='{kept['key']}']")  # notebook one's name: its own
        assert f"kernel pid {one}'s" in held and "unpin" not in held, held

        # delete another: gone from the catalogue and from the table
        page.click(f".mlxc-p .mlxc-p-file[data-key='{to_delete['key']}'] button[data-action='delete']")
        page.click(".jp-Dialog .jp-mod-accept")
        assert "deleted" in status_says(page, "deleted")
        assert catalog(lab, "SELECT 1 FROM files WHERE key=?", (to_delete["key"],)) == []
        page.wait_for_selector(f".mlxc-p .mlxc-p-file[data-key='{to_delete['key']}']", state="detached", timeout=CELL_TIMEOUT_MS)

        # restore notebook one's named checkpoint into notebook two (the current notebook)
        page.click(f".mlxc-p .mlxc-p-file[data-key='{kept['key']}'] button[data-action='restore'][data-name='keep_one']")
        said = status_says(page, "two.ipynb: checkpoint 'keep_one'")
        assert "restored" in said or "loading from SSD" in said, said
        page.click(".jp-NotebookPanel:visible .jp-Notebook .jp-Cell >> nth=4")
        page.keyboard.press("Escape")
        b.run_cells(1)
        b.wait_output("RESTORED ['keep_one']")  # in the second kernel's RAM, pinned by the name

        page.wait_for_timeout(500)
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#mlxcache-panel").screenshot(path=str(ARTIFACTS / "panel.png"))
        page.screenshot(path=str(ARTIFACTS / "panel_lab.png"))

        # live updates only while visible
        page.click(".jp-SideBar .lm-TabBar-tab[data-id='mlxcache-panel']")  # collapse the sidebar: hidden
        page.wait_for_selector("#mlxcache-panel", state="hidden", timeout=30_000)
        page.wait_for_timeout(500)
        hidden_from = len(overview_requests)
        page.wait_for_timeout(8000)  # more than two refresh periods
        hidden_requests = len(overview_requests) - hidden_from
        page.click(".jp-SideBar .lm-TabBar-tab[data-id='mlxcache-panel']")
        page.wait_for_timeout(4000)
        shown_requests = len(overview_requests) - hidden_from - hidden_requests
        console = list(b.console)
    assert hidden_requests == 0, overview_requests[-5:]
    assert shown_requests >= 1
    assert (ARTIFACTS / "panel.png").stat().st_size > 5_000
    if os.environ.get("MLXCACHE_UPDATE_README_IMAGES"):  # the README's copy changes only when asked
        shutil.copyfile(ARTIFACTS / "panel.png", DOC_IMAGES / "panel.png")
    assert not [c for c in console if c.startswith("error")], console
