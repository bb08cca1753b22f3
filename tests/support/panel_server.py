"""A real Jupyter server with the MLX Cache panel's server extension, on loopback, for tests and
benchmarks: ``PanelServer(cache_dir, workdir)``; ``get(query)`` the overview's JSON, ``post(action,
body)`` a change; ``close()``. The extension is enabled on the command line, so it runs whether or
not this environment's jupyter_server_config.d has the file (tests/test_packaging.py checks that)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PanelServer:
    def __init__(self, cache_dir: Path, workdir: Path, env: dict | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.token = free_port(), "panel-" + os.urandom(8).hex()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**(env or os.environ), "MLXCACHE_CACHE_DIR": str(cache_dir), "JUPYTER_CONFIG_DIR": str(workdir / "cfg"),
               "JUPYTER_RUNTIME_DIR": str(workdir / "runtime")}
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={workdir}", "--ServerApp.port_retries=0",
             "--ServerApp.jpserver_extensions=mlxcache_kernel.panel=True",
             *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("jupyter server exited:\n" + self.log()[-3000:])
            try:
                self.get()
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("jupyter server did not start:\n" + self.log()[-3000:])
            time.sleep(0.3)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _request(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(f"{self.base}/mlxcache/api/{path}",
                                     data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST",
                                     headers={"Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def get(self, **query) -> dict:
        status, body = self._request("overview?" + urllib.parse.urlencode(query))
        body["_status"] = status
        return body

    def post(self, action: str, **body) -> dict:
        status, answer = self._request(action, body)
        answer["_status"] = status
        return answer

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()
