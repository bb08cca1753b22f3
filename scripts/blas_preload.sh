#!/bin/sh
# Prints the LD_PRELOAD value that puts OpenBLAS under MLX's CPU matmuls, when installed.
for lib in /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
  if [ -e "$lib" ] && [ "$(uname -s)" = Linux ] && [ "${MLXCACHE_BLAS:-}" != reference ]; then
    echo "$lib${LD_PRELOAD:+:$LD_PRELOAD}"; exit 0
  fi
done
echo "${LD_PRELOAD:-}"
