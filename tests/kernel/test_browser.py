"""A real browser: JupyterLab + headless Chromium (Debian's `chromium`, driven
by playwright-python through its executable path) open a small notebook, run
it on the venv's kernel, and check that the residency dashboard renders and
its numbers change. The screenshot is kept under artifacts/.

Needs `scripts/install_browser_deps.sh` (apt `chromium`; pip `playwright`,
`jupyterlab`); skipped with the reason when they are missing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from lab_browser import ARTIFACTS, CELL_TIMEOUT_MS, DOC_IMAGES, Browser, counter, lab_server, notebook, requirements

pytestmark = pytest.mark.browser

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
    return notebook(workdir / "dashboard_api.ipynb", cells, "python3", "Python 3 (ipykernel)")


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
    return notebook(workdir / "dashboard_magics.ipynb", cells, "mlxcache", "MLX Cache (Python 3)")


@pytest.fixture(scope="module")
def jupyter_lab(tmp_path_factory):
    reason = requirements()
    if reason:
        pytest.skip(reason)
    from tiny_model import build_tiny_model

    tmp_path = tmp_path_factory.mktemp("lab")
    work = tmp_path / "work"
    work.mkdir()
    model = build_tiny_model(tmp_path / "tiny-model")
    make_api_notebook(work, model)
    make_magics_notebook(work, model)
    # the mlxcache kernel's engine: private cache, a small RAM budget, short prefill chunks
    env = dict(MLXCACHE_CACHE_DIR=str(tmp_path / "cache-magics"), MLXCACHE_RAM_BUDGET="4MB",
               MLXCACHE_PREFILL_CHUNK="64", MLXCACHE_DEFAULT_MODEL="none")
    with lab_server(tmp_path, work, env) as lab:
        yield lab


def test_dashboard_renders_and_updates_in_jupyterlab(jupyter_lab):
    """Python API on the stock ipykernel."""
    shot = ARTIFACTS / "browser_dashboard.png"
    with Browser(jupyter_lab, "dashboard_api.ipynb", "api") as b:
        page = b.page
        # cell 1: the dashboard renders, with no activity yet
        b.run_cells(1)
        page.wait_for_selector(".mlxc-dashboard .mlxc-counter[data-name='misses']", timeout=CELL_TIMEOUT_MS)
        assert counter(page, "misses") == 0
        assert counter(page, "ram_hits") == 0
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
        misses = counter(page, "misses")
        hits = counter(page, "ram_hits") + counter(page, "ssd_hits")
        written = counter(page, "bytes_written")
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
        assert counter(page, "misses") == 0
        b.run_cells(8)
        b.wait_output("DONE")
        page.wait_for_selector(".mlxc-kv-inspector .mlxc-kv-heatmap", timeout=CELL_TIMEOUT_MS)
        page.wait_for_timeout(1500)
        # the dashboard's entry previews arrive with a later refresh (a busy machine: seconds later)
        try:
            page.wait_for_function("() => { const p = [...document.querySelectorAll('.mlxc-dashboard td.mlxc-preview')];"
                                   " return p.length > 0 && p.every(e => e.innerText.length > 0); }",
                                   timeout=CELL_TIMEOUT_MS)
        except Exception as e:  # say which rows stayed empty (a fresh-clone CI once timed out here)
            rows = page.evaluate("() => [...document.querySelectorAll('.mlxc-dashboard tr.mlxc-entry')]"
                                 ".map(r => [r.innerText, r.textContent])")
            raise AssertionError(f"entry previews still empty after {CELL_TIMEOUT_MS} ms: {rows}") from e
        misses = counter(page, "misses")
        hits = counter(page, "ram_hits") + counter(page, "ssd_hits")
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
    assert "mlxcache: a resident model" in full and "%cache stats|ls [--all]" in full
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
