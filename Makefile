# Two entry points for a fresh machine: `make demo` and `make test`.
# Each builds .venv with the CPU build of torch, then the project.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv test test-fast lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU wheel first: anything that later asks for torch is then satisfied
	# and pip never pulls the multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m fast

bench: $(STAMP)
	$(PY) bench/engine_step.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
