#!/usr/bin/env bash
# Build the "MLX Cache" JupyterLab panel (TypeScript in panel/) into mlxcache_kernel/labextension
# and install it into the venv's Jupyter: the labextension under share/jupyter/labextensions and
# the server extension's config under etc/jupyter/jupyter_server_config.d (what the wheel ships
# as shared data, setup.py). npm reaches the registry here, at set-up, and never at run time.
# The build is not committed: it is generated code, rebuilt from the lock file in a minute.
# Idempotent: unchanged sources are not built again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
OUT="$ROOT/mlxcache_kernel/labextension"
STAMP="$ROOT/build/panel.stamp"
cd "$ROOT"

if ! command -v npm >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "== installing Node.js and npm (to build the JupyterLab panel)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo -n"
  $SUDO apt-get install -y -q nodejs npm >/dev/null 2>&1 \
    || ($SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q nodejs npm >/dev/null 2>&1)
fi
if ! command -v npm >/dev/null 2>&1; then
  echo "   (no npm: the MLX Cache panel is not built; JupyterLab and the kernel work without it)" >&2
  exit 0
fi

sources=$(cat panel/package.json panel/package-lock.json panel/tsconfig.json panel/install.json panel/src/*.ts panel/style/*.css \
  | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$sources" ] && [ -f "$OUT/package.json" ]; then
  echo "== MLX Cache panel: up to date"
else
  echo "== building the MLX Cache panel (npm ci, tsc, labextension build)"
  lock=$(sha256sum panel/package-lock.json | cut -d' ' -f1)
  if [ "$(cat panel/node_modules/.lock-sha256 2>/dev/null)" != "$lock" ]; then
    (cd panel && npm ci --no-audit --no-fund --loglevel=error && echo "$lock" >node_modules/.lock-sha256)
  fi
  (cd panel && npx tsc)
  export PATH="$VENV/bin:$PATH"  # jupyter-builder, jupyter
  STAGING=$("$VENV/bin/python" -c "import jupyterlab, os; print(os.path.join(os.path.dirname(jupyterlab.__file__), 'staging'))")
  if command -v jupyter-builder >/dev/null 2>&1; then  # JupyterLab 4.6 and later
    jupyter-builder build --core-package-file "$STAGING/package.json" panel >build-panel.log 2>&1 \
      || { tail -30 build-panel.log >&2; exit 1; }
  else
    jupyter labextension build --core-path "$STAGING" panel >build-panel.log 2>&1 \
      || { tail -30 build-panel.log >&2; exit 1; }
  fi
  rm -f build-panel.log
  cp panel/install.json "$OUT/"  # jupyter labextension list: installed by the Python package
  mkdir -p "$(dirname "$STAMP")" && echo "$sources" >"$STAMP"
fi

# into this venv's Jupyter, as the wheel's shared data would be installed
dest="$VENV/share/jupyter/labextensions/mlxcache-panel"
rm -rf "$dest" && mkdir -p "$(dirname "$dest")" && cp -r "$OUT" "$dest"
mkdir -p "$VENV/etc/jupyter/jupyter_server_config.d"
cp jupyter-config/server-config/mlxcache_kernel.json "$VENV/etc/jupyter/jupyter_server_config.d/"
echo "== MLX Cache panel: installed in $VENV (labextension mlxcache-panel, server extension mlxcache_kernel.panel)"
