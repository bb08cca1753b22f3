#!/usr/bin/env bash
# Install what tests/kernel/test_browser.py needs: Debian's Chromium (headless, driven
# by playwright-python through its executable path; no `playwright install`,
# which would download a browser build) and JupyterLab + playwright into the
# project venv. Idempotent: a second run only checks.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

if ! command -v chromium >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi
chromium --version 2>/dev/null

if ! "$PY" -c "import playwright, jupyterlab" >/dev/null 2>&1; then
    "$PY" -m pip install -q "playwright>=1.40" "jupyterlab>=4.1"
fi
"$PY" -c "import playwright, jupyterlab; print('jupyterlab', jupyterlab.__version__)"
