"""mlxcache-kernel: a Jupyter kernel keeping MLX models and a tiered prompt cache resident.

In the ``mlxcache`` kernel the magics are there from the start; in any other
IPython, ``%load_ext mlxcache_kernel`` adds the same magics.
"""

__version__ = "0.1.0"

from .extension import get_engine, load_ipython_extension, unload_ipython_extension  # noqa: E402
from .memo import memo  # noqa: E402  (light: the engine is imported on the first memoized call)

__all__ = ["get_engine", "load_ipython_extension", "memo", "unload_ipython_extension"]
