"""The wheel, built once from this checkout: it holds every subpackage (installed into a fresh
virtualenv, the editable install out of the way, every package imported from it and a generation
run) and the JupyterLab panel as shared data (the prebuilt labextension under
share/jupyter/labextensions/mlxcache-panel, the file that enables the server extension under
etc/jupyter/jupyter_server_config.d), as jupyter-resource-usage ships them.

A new sub-folder that packaging left out would pass every other test (the editable install maps
the source tree) and fail here. Needs the panel built (scripts/build_panel.sh, run by set-up).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
from repo_paths import ROOT

SCRIPT = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import mlxcache_kernel
    from mlxcache_kernel.engine import Engine, SamplingParams
    names = [m.name for m in pkgutil.walk_packages(mlxcache_kernel.__path__, "mlxcache_kernel.")]
    for name in names:
        importlib.import_module(name)
    with Engine(cache_dir=sys.argv[2], ssd=False) as eng:
        eng.load_model(sys.argv[1])
        r = eng.generate_tokens([5, 6, 7, 8], params=SamplingParams(max_tokens=4))
    print(json.dumps({"file": mlxcache_kernel.__file__, "modules": names, "tokens": r.tokens}))
""")


def source_packages() -> set[str]:
    out = set()
    for folder, package in (("mlxcache_kernel", "mlxcache_kernel"), ("engine", "mlxcache_kernel.engine"),
                            ("widgets", "mlxcache_kernel.widgets")):
        for init in (ROOT / folder).rglob("__init__.py"):
            out.add(".".join([package, *init.parent.relative_to(ROOT / folder).parts]))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    built = ROOT / "mlxcache_kernel" / "labextension" / "package.json"
    assert built.exists(), "the panel is not built: run scripts/build_panel.sh"
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(dist), str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    [whl] = dist.glob("mlxcache_kernel-*.whl")
    return whl


def test_the_wheel_installs_every_package_and_generates(wheel, tmp_path, tiny_model_dir):
    in_wheel = {os.path.dirname(n).replace("/", ".") for n in zipfile.ZipFile(wheel).namelist()
                if n.endswith("/__init__.py")}
    assert in_wheel == source_packages()

    fresh = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    python = fresh / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", site,
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300)
    # Dependencies from this environment; its .pth files (the editable install) are not processed.
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(python), "-c", SCRIPT, str(tiny_model_dir), str(tmp_path / "cache")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(site) and len(got["tokens"]) == 4
    assert set(got["modules"]) >= source_packages() - {"mlxcache_kernel"}


def test_the_wheel_ships_the_panel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("mlxcache_kernel/panel/handlers.py", "mlxcache_kernel/engine/admin/overview.py",
                   "mlxcache_kernel/engine/cache/catalog/reading.py", "mlxcache_kernel/widgets/dashboard.py"):
        assert module in names, module
    data = next(n.split("/")[0] for n in names if ".data/" in n)
    lab = f"{data}/data/share/jupyter/labextensions/mlxcache-panel/"
    assert f"{lab}package.json" in names and f"{lab}install.json" in names
    assert any(n.startswith(f"{lab}static/remoteEntry.") and n.endswith(".js") for n in names)
    config = f"{data}/data/etc/jupyter/jupyter_server_config.d/mlxcache_kernel.json"
    enabled = json.loads(zipfile.ZipFile(wheel).read(config))
    assert enabled == {"ServerApp": {"jpserver_extensions": {"mlxcache_kernel.panel": True}}}
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Framework :: Jupyter :: JupyterLab :: Extensions :: Prebuilt" in meta
    package = json.loads(zipfile.ZipFile(wheel).read(f"{lab}package.json"))
    assert package["name"] == "mlxcache-panel" and package["jupyterlab"]["_build"]["load"].startswith("static/")


def _installed_closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements bring, with no extra (as installed here, recursively)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    todo, seen = [Requirement(r) for r in requirements], set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in distribution(req.name).requires or []]
        except PackageNotFoundError:
            continue
    return seen


def test_the_command_line_needs_no_extra(wheel):
    """`mlxcache-kernel run NOTEBOOK` (what `make demo` runs) and `install` import only what a plain
    `pip install` of the wheel brings: every third-party module they import is in the closure of the
    wheel's requirements without an extra (nbclient once was only in the test extra)."""
    from importlib.metadata import packages_distributions

    from packaging.utils import canonicalize_name

    metadata = zipfile.ZipFile(wheel).read(next(n for n in zipfile.ZipFile(wheel).namelist()
                                                if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    closure = _installed_closure(requires)
    imported = set()
    for module in ("cli.py", "runner.py", "kernelspec.py"):
        for node in ast.walk(ast.parse((ROOT / "mlxcache_kernel" / module).read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "mlxcache_kernel"}
    owners = packages_distributions()
    missing = {m for m in third_party if not {canonicalize_name(d) for d in owners.get(m, [m])} & closure}
    assert {"nbclient", "jupyter_client"} <= third_party and not missing, missing
