"""Fixtures of the kernel-side tests: an in-process IPython shell with the extension, real kernels."""

import os

import pytest
from kernel_client import Kernel


@pytest.fixture(scope="session")
def shell():
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    return start_ipython() or get_ipython()  # None when another test module started it first


@pytest.fixture
def ip(shell, tiny_model_dir, tmp_path, monkeypatch):
    """The shell with the extension loaded on a fresh cache dir; the tiny model is the default."""
    import mlxcache_kernel

    monkeypatch.setenv("MLXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLXCACHE_DEFAULT_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("MLXCACHE_RAM_BUDGET", "256MiB")
    for var in ("MLXCACHE_SSD_BUDGET", "MLXCACHE_WRITE_BEHIND", "MLXCACHE_PREFILL_CHUNK", "MLXCACHE_SSD",
                "MLXCACHE_IDLE_DEMOTE_S", "MLXCACHE_PREFETCH_BUDGET"):
        monkeypatch.delenv(var, raising=False)
    mlxcache_kernel.unload_ipython_extension(shell)
    shell.extension_manager.loaded.discard("mlxcache_kernel")
    shell.config.pop("MLXCache", None)
    shell.run_line_magic("load_ext", "mlxcache_kernel")
    shell.tiny_model_dir = tiny_model_dir
    yield shell
    mlxcache_kernel.unload_ipython_extension(shell)
    shell.extension_manager.loaded.discard("mlxcache_kernel")
    shell.config.pop("MLXCache", None)
    for name in ("g", "g2", "kvs", "doc", "question", "n"):
        shell.user_ns.pop(name, None)


@pytest.fixture
def kernel_env(tmp_path, tiny_model_dir):
    env = dict(os.environ)
    env.update(
        MLXCACHE_CACHE_DIR=str(tmp_path / "cache"),
        MLXCACHE_DEFAULT_MODEL=str(tiny_model_dir),
        MLXCACHE_RAM_BUDGET="256MiB",
        JUPYTER_PLATFORM_DIRS="1",
    )
    for var in ("MLXCACHE_WRITE_BEHIND", "MLXCACHE_SSD_BUDGET", "MLXCACHE_SSD"):
        env.pop(var, None)
    return env


@pytest.fixture
def start_kernel(spec_prefix, kernel_env, tmp_path):
    kernels = []

    def start(**extra_env) -> Kernel:
        env = {**kernel_env, **extra_env}
        k = Kernel(spec_prefix, env, tmp_path / f"kernel{len(kernels)}.log")
        kernels.append(k)
        return k

    yield start
    for k in kernels:
        k.shutdown()
