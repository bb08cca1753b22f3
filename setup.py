"""The packages: every folder with an __init__.py under mlxcache_kernel/, engine/ and widgets/,
installed as mlxcache_kernel, mlxcache_kernel.engine and mlxcache_kernel.widgets (the top-level
layout the design asks for). Found, not listed, so a new sub-folder is never left out of the wheel
(tests/test_packaging.py builds one). The rest of the metadata is in pyproject.toml.

Shared data, as jupyter-resource-usage ships it: the built JupyterLab panel (scripts/build_panel.sh
writes mlxcache_kernel/labextension) under share/jupyter/labextensions/mlxcache-panel, and the file
that enables the server extension under etc/jupyter/jupyter_server_config.d."""

from pathlib import Path

from setuptools import setup

ROOTS = {"mlxcache_kernel": "mlxcache_kernel", "mlxcache_kernel.engine": "engine", "mlxcache_kernel.widgets": "widgets"}


def package_dirs() -> dict[str, str]:
    here = Path(__file__).resolve().parent
    found = {}
    for package, folder in ROOTS.items():
        for init in sorted((here / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(here / folder).parts
            found[".".join((package, *parts))] = str(init.parent.relative_to(here))
    return found


LABEXTENSION = "share/jupyter/labextensions/mlxcache-panel"


def data_files() -> list[tuple[str, list[str]]]:
    here = Path(__file__).resolve().parent
    out = [("etc/jupyter/jupyter_server_config.d", ["jupyter-config/server-config/mlxcache_kernel.json"])]
    built = here / "mlxcache_kernel" / "labextension"
    for folder in sorted({p.parent for p in built.rglob("*") if p.is_file()}):
        files = sorted(str(p.relative_to(here)) for p in folder.iterdir() if p.is_file())
        out.append(("/".join([LABEXTENSION, *folder.relative_to(built).parts]), files))
    return out


dirs = package_dirs()
setup(packages=sorted(dirs), package_dir=dirs, data_files=data_files())
