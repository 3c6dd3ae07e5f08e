# Two entry points for a fresh machine: `make demo` and `make test`.
# Each builds .venv with the CPU build of torch, then the project.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU wheel first: anything that later asks for torch is then satisfied
	# and pip never pulls the multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# Until the vLLM connector lands, the demo records a simulated hybrid-model
# workload (vLLM's scheduler, block pool and workers, with injected failures)
# and replays its log with every invariant checked.
demo: $(STAMP)
	mkdir -p bench/out
	$(VENV)/bin/kvledger simulate --scenario hybrid --steps 300 --fail-rate 0.1 --out bench/out/demo.log --force
	$(VENV)/bin/kvledger replay bench/out/demo.log --check

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m fast

bench: $(STAMP)
	$(PY) bench/engine_step.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
