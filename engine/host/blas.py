"""Fast BLAS on Linux: MLX's CPU wheel bundles a slow reference BLAS.

Preloading Debian's OpenBLAS (`libopenblas0-pthread`) makes float32 matmul
10-20x faster. A preload only works from process start, so the processes we
launch (CLI, kernel, benchmarks) get it through their environment or a
re-exec; everything stays correct without it.
"""

from __future__ import annotations

import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)
_REEXEC_MARK = "MLXCACHE_BLAS_REEXEC"


def openblas_path() -> str | None:
    """The OpenBLAS library to preload, or None (env MLXCACHE_BLAS=reference disables)."""
    if not sys.platform.startswith("linux") or os.environ.get("MLXCACHE_BLAS") == "reference":
        return None
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def active_blas() -> str:
    """Which BLAS this process actually runs MLX matmuls with."""
    if sys.platform == "darwin":
        return "accelerate"
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown"
    for path in OPENBLAS_CANDIDATES:  # numpy's own bundled OpenBLAS does not count
        if path in maps or os.path.realpath(path) in maps:
            return "openblas:" + os.path.realpath(path)
    return "bundled-reference"


def fast_blas_env(env: dict | None = None) -> dict:
    """A copy of env with OpenBLAS preloaded when it is available."""
    env = dict(os.environ if env is None else env)
    lib = openblas_path()
    if lib:
        current = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
        if lib not in current:
            env["LD_PRELOAD"] = ":".join([lib, *current])
    return env


def ensure_fast_blas() -> None:
    """Re-exec the current process with OpenBLAS preloaded, once, if it helps.

    Call before importing mlx. Does nothing where OpenBLAS is missing or
    already loaded.
    """
    lib = openblas_path()
    if not lib or active_blas().startswith("openblas") or os.environ.get(_REEXEC_MARK):
        return
    env = fast_blas_env()
    env[_REEXEC_MARK] = "1"
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return  # keep running on the reference BLAS
