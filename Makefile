# The two commands a newcomer needs (each sets up .venv on first use: CPU torch where there is no CUDA GPU):
#   make demo   - train experiment=demo on the built-in brain phantom (CPU, minutes)
#   make test   - run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: demo test setup bench
setup:
	bash scripts/setup_env.sh

demo:
	bash scripts/setup_env.sh
	$(PY) train.py experiment=demo $(ARGS)

test:
	bash scripts/setup_env.sh test
	$(PY) -m pytest -n auto --maxprocesses=2 --dist loadgroup $(ARGS)

bench:
	bash scripts/setup_env.sh test
	$(PY) bench/bench_preflight.py --memo-baseline
	$(PY) bench/bench_system.py
	$(PY) bench/bench_sampling.py
