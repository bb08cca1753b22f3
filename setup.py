"""The packages: every folder with an __init__.py under mlxcache_kernel/, engine/ and widgets/,
installed as mlxcache_kernel, mlxcache_kernel.engine and mlxcache_kernel.widgets (the top-level
layout the design asks for). Found, not listed, so a new sub-folder is never left out of the wheel
(tests/test_packaging.py builds and installs one). The rest of the metadata is in pyproject.toml."""

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


dirs = package_dirs()
setup(packages=sorted(dirs), package_dir=dirs)
