"""Run a notebook headless on the ``mlxcache`` kernel and print what it shows.

``mlxcache-kernel run examples/quickstart.ipynb`` executes every cell with
nbclient against the installed kernelspec (installing it first if this
environment has none) and prints each cell's source and outputs. A code
cell tagged ``restart-kernel`` restarts the kernel before it runs, the way
a person would from the Kernel menu, so ``examples/restart_resume.ipynb`` shows a
real restart. ``--allow-errors`` runs on past a failing cell (each error is
printed where it happened), like ``jupyter nbconvert --allow-errors``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

RESTART_TAG = "restart-kernel"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def ensure_kernelspec(name: str = "mlxcache", *, quiet: bool = False) -> str:
    """The kernelspec's directory; installs it (default scope) when Jupyter cannot find it."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        return KernelSpecManager().get_kernel_spec(name).resource_dir
    except NoSuchKernel:
        from .kernelspec import default_scope, install

        scope = default_scope()
        dest = install(user=scope == "user", sys_prefix=scope == "sys-prefix", name=name)
        if not quiet:
            print(f"[installed the {name!r} kernelspec in {dest}]", file=sys.stderr)
        return dest


def execute_notebook(
    path: str | os.PathLike,
    *,
    kernel_name: str = "mlxcache",
    timeout: int = 1200,
    env: dict | None = None,
    kernel_spec_manager=None,
    on_cell=None,
    allow_errors: bool = False,
):
    """Execute the notebook at ``path``; returns the executed NotebookNode.

    Cells tagged ``restart-kernel`` restart the kernel before they run.
    ``on_cell(index, cell)`` is called after each cell (for live printing).
    Raises nbclient's CellExecutionError on an unexpected error (cells tagged
    ``raises-exception`` may fail).
    """
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    km_kwargs = {"kernel_name": kernel_name}
    if kernel_spec_manager is not None:
        km_kwargs["kernel_spec_manager"] = kernel_spec_manager
    km = KernelManager(**km_kwargs)
    client = NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        kernel_name=kernel_name,
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(path.parent.resolve())}},
        record_timing=True,
    )
    start_kw = {"env": env} if env is not None else {}
    try:
        with client.setup_kernel(**start_kw):
            assert client.kc is not None
            client.kc.wait_for_ready(timeout=120)
            for index, cell in enumerate(nb.cells):
                if cell.cell_type == "code" and RESTART_TAG in cell.metadata.get("tags", []):
                    t0 = time.perf_counter()
                    km.restart_kernel(now=False, **start_kw)
                    client.kc.wait_for_ready(timeout=120)
                    cell.metadata.setdefault("mlxcache", {})["restart_s"] = round(time.perf_counter() - t0, 3)
                client.execute_cell(cell, index)
                if on_cell is not None:
                    on_cell(index, cell)
    finally:
        # We own the kernel manager, so nbclient leaves the kernel running: shut it down
        # gracefully, which flushes pending cache writes (and logs it).
        if client.kc is not None:
            client.kc.stop_channels()
        if km.has_kernel:
            km.shutdown_kernel(now=False)
    return nb


def cell_outputs_text(cell) -> str:
    """The text a reader would see under a code cell (widgets shown as placeholders)."""
    parts: list[str] = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            parts.append(out.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "application/vnd.jupyter.widget-view+json" in data:
                parts.append("[widget]\n")
            elif data.get("text/plain"):
                text = data["text/plain"]
                prefix = f"Out[{out.get('execution_count')}]: " if kind == "execute_result" else ""
                parts.append(prefix + text + "\n")
        elif kind == "error":
            parts.append(error_text(out))
    return _ANSI.sub("", "".join(parts))


def error_text(out) -> str:
    """An error output as a reader sees it: the traceback when the kernel sent one
    (a UsageError has none), else ``ename: evalue``."""
    tb = [ln for ln in out.get("traceback") or [] if ln.strip()]
    text = "\n".join(tb) if tb else f"{out.get('ename')}: {out.get('evalue')}"
    return _ANSI.sub("", text).rstrip("\n") + "\n"


def cell_failed(cell) -> bool:
    """An error output, or a UsageError (which IPython prints to stderr instead)."""
    return any(o.get("output_type") == "error" or (o.get("name") == "stderr" and "UsageError: " in o.get("text", ""))
               for o in cell.get("outputs", []))


def format_cell(index: int, cell) -> str:
    if cell.cell_type == "markdown":
        return ""
    lines = [f"In [{cell.get('execution_count') or ' '}]:"]
    lines += ["    " + ln for ln in cell.source.splitlines()]
    restart = cell.metadata.get("mlxcache", {}).get("restart_s")
    if restart is not None:
        lines.insert(0, f"--- kernel restarted ({restart:.1f} s) ---")
    out = cell_outputs_text(cell).rstrip("\n")
    if out:
        lines.append("")
        lines += out.splitlines()
    return "\n".join(lines) + "\n"


def cmd_run(args) -> int:
    """Execute a notebook headless on the mlxcache kernel, printing each cell as it finishes."""
    from nbclient.exceptions import CellExecutionError

    path = Path(args.notebook)
    if not path.is_file():
        print(f"error: no such notebook: {path}", file=sys.stderr)
        return 1
    try:
        ensure_kernelspec(args.kernel)
    except (OSError, ValueError) as e:
        print(f"error: could not install the kernelspec: {e}", file=sys.stderr)
        return 1

    def show(index, cell):
        text = format_cell(index, cell)
        if text:
            print(text, flush=True)

    t0 = time.perf_counter()
    try:
        nb = execute_notebook(path, kernel_name=args.kernel, timeout=args.timeout, on_cell=show,
                              allow_errors=args.allow_errors)
    except CellExecutionError as e:
        print(f"error: a cell failed:\n{e}", file=sys.stderr)
        return 1
    except Exception as e:  # kernel died, timeout, ...
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.output:
        import nbformat

        nbformat.write(nb, args.output)
        print(f"[executed notebook written to {args.output}]")
    failed = [c for c in nb.cells if cell_failed(c)]
    print(f"[{path.name}: {sum(c.cell_type == 'code' for c in nb.cells)} code cells in "
          f"{time.perf_counter() - t0:.1f} s" + (f"; {len(failed)} raised an error" if failed else "") + "]")
    return 0


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("run", help="execute a notebook headless on the mlxcache kernel and print its outputs")
    p.add_argument("notebook", help="the .ipynb file")
    p.add_argument("--kernel", default="mlxcache", help="kernelspec name (default: mlxcache)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per cell (default 1200)")
    p.add_argument("--output", "-o", default=None, help="also write the executed notebook here")
    p.add_argument("--allow-errors", action="store_true",
                   help="run every cell even when one fails, printing each error in place (exit status 0)")
    p.set_defaults(func=cmd_run)
