"""Install the ``mlxcache`` kernelspec.

``kernel.json`` runs ``python -m mlxcache_kernel -f {connection_file}`` with
this interpreter; on Linux its environment preloads OpenBLAS (MLX's CPU wheel
bundles a slow reference BLAS).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

KERNEL_NAME = "mlxcache"
DISPLAY_NAME = "MLX Cache (Python 3)"


def kernel_json(*, display_name: str = DISPLAY_NAME, env: dict | None = None, python: str | None = None) -> dict:
    from mlxcache_kernel.engine.host.blas import fast_blas_env

    spec_env = fast_blas_env({})  # only LD_PRELOAD (when OpenBLAS is there), not this shell's environment
    spec_env.update(env or {})
    spec = {
        "argv": [python or sys.executable, "-m", "mlxcache_kernel", "-f", "{connection_file}"],
        "display_name": display_name,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": True},
    }
    if spec_env:
        spec["env"] = spec_env
    return spec


def write_kernel_spec(path: str | os.PathLike, **kwargs) -> Path:
    """Write kernel.json (and the logos) into directory ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernel.json").write_text(json.dumps(kernel_json(**kwargs), indent=1) + "\n")
    try:
        import ipykernel

        resources = Path(ipykernel.__file__).parent / "resources"
        for logo in resources.glob("logo-*"):
            shutil.copy(logo, path / logo.name)
    except (ImportError, OSError):
        pass
    return path


def default_scope() -> str:
    """``sys-prefix`` inside a virtual environment (where its Jupyter looks), else ``user``."""
    return "sys-prefix" if sys.prefix != getattr(sys, "base_prefix", sys.prefix) else "user"


def install(
    *,
    user: bool = False,
    sys_prefix: bool = False,
    prefix: str | os.PathLike | None = None,
    name: str = KERNEL_NAME,
    display_name: str = DISPLAY_NAME,
    env: dict | None = None,
) -> str:
    """Install the kernelspec; returns the directory it was installed to.

    At most one of ``user``, ``sys_prefix`` and ``prefix``; with none,
    :func:`default_scope` decides.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    if sum(bool(x) for x in (user, sys_prefix, prefix)) > 1:
        raise ValueError("choose one of --user, --sys-prefix and --prefix")
    if not (user or sys_prefix or prefix):
        user, sys_prefix = default_scope() == "user", default_scope() == "sys-prefix"
    if sys_prefix:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as tmp:
        src = write_kernel_spec(Path(tmp) / name, display_name=display_name, env=env)
        return KernelSpecManager().install_kernel_spec(
            str(src), kernel_name=name, user=bool(user), prefix=str(prefix) if prefix else None
        )


# --- command line: ``mlxcache-kernel install`` and ``mlxcache-kernel lab`` ---


def cmd_install(args) -> int:
    try:
        dest = install(user=args.user, sys_prefix=args.sys_prefix, prefix=args.prefix, name=args.name,
                       display_name=args.display_name)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    spec = json.loads((Path(dest) / "kernel.json").read_text())
    preload = spec.get("env", {}).get("LD_PRELOAD")
    print(f"installed kernelspec {args.name!r} ({args.display_name}) in {dest}")
    print(f"  python: {spec['argv'][0]}")
    print(f"  BLAS:   {'OpenBLAS preloaded (' + preload + ')' if preload else 'MLX default'}")
    return 0


def cmd_lab(args) -> int:
    """Install the kernelspec where this environment's Jupyter looks, then run JupyterLab."""
    import importlib.util

    if importlib.util.find_spec("jupyterlab") is None:
        print("error: JupyterLab is not installed in this environment: pip install jupyterlab", file=sys.stderr)
        return 1
    try:
        dest = install(user=args.user, sys_prefix=args.sys_prefix, prefix=args.prefix)
    except (ValueError, OSError) as e:
        print(f"error: could not install the kernelspec: {e}", file=sys.stderr)
        return 1
    print(f"kernelspec 'mlxcache' installed in {dest}", flush=True)
    if not (Path(sys.prefix) / "share" / "jupyter" / "labextensions" / "mlxcache-panel" / "package.json").exists():
        print("note: the MLX Cache side panel is not installed here (scripts/build_panel.sh builds it)", flush=True)
    from mlxcache_kernel.engine.host.blas import fast_blas_env

    env = fast_blas_env()
    if args.prefix:  # make sure this server looks there
        data = str(Path(args.prefix) / "share" / "jupyter")
        env["JUPYTER_PATH"] = os.pathsep.join(p for p in (data, env.get("JUPYTER_PATH")) if p)

    lab_args = [a for a in args.lab_args if a != "--"]
    if args.port is not None:
        lab_args.append(f"--port={args.port}")
    if args.ip is not None:
        lab_args.append(f"--ip={args.ip}")
    if args.no_browser:
        lab_args.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in lab_args:
        lab_args.append("--allow-root")  # Jupyter refuses root otherwise (containers, CI)
    argv = [sys.executable, "-m", "jupyterlab", *lab_args]
    os.execve(sys.executable, argv, env)
    return 0  # pragma: no cover


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("install", help="install the 'mlxcache' Jupyter kernelspec")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user (~/.local/share/jupyter)")
    where.add_argument("--sys-prefix", action="store_true",
                       help="into this Python environment (sys.prefix); the default inside a virtualenv")
    where.add_argument("--prefix", default=None, help="under PREFIX/share/jupyter/kernels")
    p.add_argument("--name", default=KERNEL_NAME, help=f"kernelspec name (default: {KERNEL_NAME})")
    p.add_argument("--display-name", default=DISPLAY_NAME, help=f"name shown in menus (default: {DISPLAY_NAME!r})")
    p.set_defaults(func=cmd_install)
    lab = subparsers.add_parser("lab", help="install the kernelspec and open JupyterLab (extra args go to jupyter lab)")
    lab_where = lab.add_mutually_exclusive_group()
    lab_where.add_argument("--user", action="store_true", help="install the kernelspec for this user")
    lab_where.add_argument("--sys-prefix", action="store_true", help="install it into this Python environment")
    lab_where.add_argument("--prefix", default=None, help="install it under PREFIX/share/jupyter/kernels")
    lab.add_argument("--port", type=int, default=None, help="port for the server")
    lab.add_argument("--ip", default=None, help="address to listen on")
    lab.add_argument("--no-browser", action="store_true", help="do not open a browser")
    lab.add_argument("lab_args", nargs="*", help="more jupyter lab arguments, after --")
    lab.set_defaults(func=cmd_lab)
