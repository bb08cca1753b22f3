"""Shared pieces of the benchmarks: the fast-BLAS re-exec, prompts of a given
token length, and timing helpers. Every benchmark prints one JSON object."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from mlxcache_kernel.engine.host.blas import ensure_fast_blas

ensure_fast_blas()  # before MLX loads: OpenBLAS must be in the process from the start


def default_model() -> str:
    from mlxcache_kernel.engine.models.convert import ensure_default_model

    return os.environ.get("MLXCACHE_BENCH_MODEL") or str(ensure_default_model())


def prompt_tokens(tokenizer, n: int, salt: str = "") -> list[int]:
    """Exactly n token ids of varied English-like text (no long exact repeats)."""
    parts, i = [], 0
    while True:
        parts.append(
            f"{salt}Paragraph {i}: the committee reviewed item {i * 7 + 3} of the budget, noted a variance of "
            f"{(i * 37) % 101} percent in region {chr(65 + i % 26)}, and asked for a revised estimate by week {i % 52 + 1}. "
        )
        i += 1
        if i % 16 == 0:
            ids = tokenizer.encode("".join(parts))
            if len(ids) >= n:
                return list(ids[:n])


def median(xs):
    return statistics.median(xs) if xs else None


def versions() -> dict:
    """The versions every figure is recorded with (docs/benchmarks.md): mlx, mlx-lm and Python."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"mlx": installed("mlx"), "mlx_lm": installed("mlx-lm"), "python": sys.version.split()[0]}


def emit(result: dict) -> None:
    from mlxcache_kernel.engine.host.blas import active_blas

    result = {"blas": active_blas(), **versions(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **result}
    print(json.dumps(result, indent=2))


def behind_link(rate: str, script: str) -> None:
    """Run `script` again (with this process's arguments) in a network namespace whose loopback
    passes `rate` (tc tbf, e.g. 1gbit): a server started there answers as from another host behind
    that link; the CPU is still this machine's. Linux, root."""
    import shlex
    import shutil

    if not (sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("unshare") and shutil.which("tc")):
        raise SystemExit("--link needs Linux, root, unshare and tc (a network namespace with a rate-limited loopback)")
    setup = (f"ip link set lo up && tc qdisc add dev lo root tbf rate {shlex.quote(rate)} burst 2mb latency 50ms"
             ' && exec "$0" "$@"')
    os.environ["MLXCACHE_BENCH_LINK"] = rate
    os.execvp("unshare", ["unshare", "--net", "sh", "-c", setup, sys.executable, script, *sys.argv[1:]])
