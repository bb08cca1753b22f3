# Every target does its own set-up first (idempotent), so each works on a fresh clone.
VENV := .venv
PY := $(VENV)/bin/python
# OpenBLAS under MLX's CPU matmuls (evaluated per command: set-up may just have installed it).
FAST := LD_PRELOAD="$$(sh scripts/blas_preload.sh)"

.PHONY: setup demo test test-fast lab bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(FAST) $(VENV)/bin/mlxcache-kernel run examples/quickstart.ipynb

test: setup
	@if [ -f scripts/install_browser_deps.sh ]; then bash scripts/install_browser_deps.sh; fi
	$(FAST) $(PY) -m pytest -q -ra --durations=15

test-fast: setup
	$(FAST) $(PY) -m pytest -q -ra -m "not smollm and not browser and not slow"

lab: setup
	$(FAST) $(VENV)/bin/mlxcache-kernel lab examples/

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(FAST) $(PY) $$b; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache artifacts
