"""``python -m mlxcache_kernel -f CONNECTION_FILE``: launch the MLX Cache kernel."""

from __future__ import annotations


def main() -> None:
    from mlxcache_kernel.engine.host.blas import ensure_fast_blas

    ensure_fast_blas()  # re-exec with OpenBLAS preloaded when the kernelspec did not already
    from ipykernel.kernelapp import IPKernelApp

    from mlxcache_kernel.kernel import MLXCacheKernel

    IPKernelApp.launch_instance(kernel_class=MLXCacheKernel)


if __name__ == "__main__":
    main()
