"""The panel's HTTP API, under ``<base_url>/mlxcache/api/``:

    GET  overview?group=&sort=&desc=&q=&pinned=&limit=&offset=   engine/admin/overview.py, plus which
                                                                  notebook each kernel pid serves
    POST pin {namespace, key, name} · unpin {name} · delete {namespace, key}

Reads run on one thread of their own and changes on another, never on the server's event
loop: a busy catalogue or a slow disk delays the answer, never the server. Every answer is
JSON; a failure is a message (``state: "error"`` or ``ok: false``), its traceback goes to the
server's log only. The cache directory is the kernels' (MLXCACHE_CACHE_DIR, else the default).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
from concurrent.futures import ThreadPoolExecutor

import tornado
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from mlxcache_kernel.engine.config import cache_dir_from_env
from mlxcache_kernel.engine.admin.panel_actions import DirectoryActions
from mlxcache_kernel.engine.named.checkpoints import CheckpointNameError
from mlxcache_kernel.engine.admin.overview import DirectoryOverview

ROUTE = "mlxcache/api"


class Panel:
    """What the handlers share: the directory's overview and actions, and their threads."""

    def __init__(self, cache_dir):
        self.overview = DirectoryOverview(cache_dir)
        self.actions = DirectoryActions(cache_dir)
        self.reads = ThreadPoolExecutor(1, thread_name_prefix="mlxcache-panel-read")
        self.changes = ThreadPoolExecutor(1, thread_name_prefix="mlxcache-panel-change")

    def close(self) -> None:
        self.reads.shutdown(wait=False)
        # At exit the executors take no new work (submit raised, a traceback as the server stopped):
        # the changes under way finish, then the store closes here (its catalogue is not thread-bound).
        self.changes.shutdown(wait=True)
        self.actions.close()


class _Handler(APIHandler):
    @property
    def panel(self) -> Panel:
        return self.settings["mlxcache_panel"]

    def _reply(self, body: dict, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(body))


class OverviewHandler(_Handler):
    @tornado.web.authenticated
    async def get(self):
        arg = self.get_argument
        try:
            page = {"sort": arg("sort", "last_used"), "descending": arg("desc", "1") != "0",
                    "query": arg("q", ""), "pinned": arg("pinned", "all"), "limit": int(arg("limit", "50")),
                    "offset": int(arg("offset", "0"))}
            group = arg("group", "") or None
            loop = asyncio.get_running_loop()
            body = await loop.run_in_executor(self.panel.reads, lambda: self.panel.overview.snapshot(group, **page))
        except ValueError as e:
            return self._reply({"state": "error", "message": str(e)}, 400)
        except Exception as e:  # a state, never a stack trace in the panel
            self.log.exception("mlxcache panel: overview failed")
            return self._reply({"state": "error", "message": f"{type(e).__name__}: {e}"})
        body["kernels"] = await self._kernels()
        self._reply(body)

    async def _kernels(self) -> dict:
        """pid -> {kernel_id, name, path} of this server's running kernels."""
        paths = {}
        try:
            for s in await self.session_manager.list_sessions():
                if s.get("kernel"):
                    paths[s["kernel"]["id"]] = s.get("path")
        except Exception:
            self.log.debug("mlxcache panel: no sessions", exc_info=True)
        out = {str(os.getpid()): {"kernel_id": None, "name": None, "path": "this Jupyter server (the panel's changes)"}}
        for kid in list(self.kernel_manager.list_kernel_ids()):
            try:
                km = self.kernel_manager.get_kernel(kid)
                pid = getattr(getattr(km, "provisioner", None), "pid", None)
            except Exception:
                continue
            if pid:
                out[str(pid)] = {"kernel_id": kid, "name": km.kernel_name, "path": paths.get(kid)}
        return out


class ActionHandler(_Handler):
    """POST pin / unpin / delete: one JSON object in, {"ok", "message"} out."""

    @tornado.web.authenticated
    async def post(self, action: str):
        try:
            args = json.loads(self.request.body or b"{}")
            if not isinstance(args, dict):
                raise ValueError("the request body must be a JSON object")
            fn = {"pin": lambda: self.panel.actions.pin(args.get("namespace"), args.get("key"), args.get("name")),
                  "unpin": lambda: self.panel.actions.unpin(args.get("name")),
                  "delete": lambda: self.panel.actions.delete(args.get("namespace"), args.get("key"))}[action]
            body = await asyncio.get_running_loop().run_in_executor(self.panel.changes, fn)
        except (ValueError, CheckpointNameError) as e:
            return self._reply({"ok": False, "message": str(e).splitlines()[0]}, 400)
        except Exception as e:
            self.log.exception("mlxcache panel: %s failed", action)
            return self._reply({"ok": False, "message": f"{action} failed: {type(e).__name__}: {e}"})
        self.log.info("mlxcache panel: %s %s: %s", action, {k: args.get(k) for k in ("name", "key")}, body["message"])
        self._reply(body)


def setup(serverapp) -> None:
    web_app = serverapp.web_app
    panel = Panel(cache_dir_from_env())
    web_app.settings["mlxcache_panel"] = panel
    base = url_path_join(web_app.settings["base_url"], ROUTE)
    web_app.add_handlers(".*$", [(url_path_join(base, "overview"), OverviewHandler),
                                 (url_path_join(base, "(pin|unpin|delete)"), ActionHandler)])
    serverapp.log.info("mlxcache panel: serving %s at %s", panel.overview.cache_dir, base)
    atexit.register(panel.close)  # the store's catalogue row goes; a killed server is found dead by pid
