"""The JupyterLab side panel "MLX Cache": a Jupyter server extension serving one view of every
kernel's cache on the cache directory, and the changes the panel may make.

- `handlers.py`: the HTTP API under ``/mlxcache/api/`` (the overview as JSON: engine/admin/overview.py;
  pin, unpin and delete: engine/admin/panel_actions.py), run off the server's event loop.
- `restore.py`: what "restore into this notebook" runs in the notebook's own kernel.

The drawing is a prebuilt labextension (TypeScript in ``panel/`` of the repository, built into
``mlxcache_kernel/labextension`` and shipped as ``share/jupyter/labextensions/mlxcache-panel``);
``jupyter-config/server-config/mlxcache_kernel.json`` enables this extension. A JupyterLab without
either still runs the kernel and everything else.
"""

from __future__ import annotations


def _jupyter_server_extension_points():
    return [{"module": "mlxcache_kernel.panel"}]


def _load_jupyter_server_extension(serverapp) -> None:
    from .handlers import setup

    setup(serverapp)
