"""Real mounts for a test without touching the machine: a subprocess in a user and mount
namespace of its own (`unshare -Urm`, Linux), root there, mounts what it needs (tmpfs, ramfs,
a tmpfs over /proc) and runs a Python script; nobody outside sees its mounts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

# unshare(CLONE_NEWUSER) refuses a process with threads: without the preloaded BLAS (its threads)
ENV = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _namespaces_work() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, env=ENV).returncode == 0


needs_namespaces = pytest.mark.skipif(not _namespaces_work(), reason="no user and mount namespaces (unshare -Urm)")


def in_namespace(mounts: list[str], script: str, env: dict | None = None) -> dict:
    """Run `script` (Python, printing one JSON line last) after the shell commands `mounts`."""
    shell = " && ".join(mounts + ['exec "$0" -c "$1"'])
    r = subprocess.run(["unshare", "-Urm", "--fork", "sh", "-c", shell, sys.executable, textwrap.dedent(script)],
                       capture_output=True, text=True, timeout=300, env={**ENV, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])
