# Two commands do all the set-up on a fresh machine:
#   make demo   installs into .venv and runs the embedded demo (the main job)
#   make test   installs into .venv (with the dev extra) and runs the whole test suite
# Installs use the versions CI tested: requirements/lock.txt (regenerate: make lock).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LOCK ?= requirements/lock.txt
# The numerics-heavy tests, run once more with torch's portable CPU kernels (make test-numerics).
NUMERICS_TESTS := tests/test_losses.py tests/test_trl_equivalence.py tests/test_policy.py \
	tests/test_advantages.py tests/test_calibadv.py tests/test_rollout.py tests/test_trainer_loop.py \
	tests/test_trainer_diagnostics.py tests/test_judge_llm.py tests/test_judge_pruned_forward.py tests/test_judge_programmatic.py \
	tests/test_judge_core.py tests/test_judge_metrics.py tests/test_rewards.py tests/test_retrieval_metrics.py

.PHONY: install install-dev demo demo-quick test test-fast test-numerics lock proto bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# CPU build of torch first (its version comes from the lock): a bare `torch` requirement
# would pull a multi-GB CUDA build.
install: $(BIN)/python
	$(BIN)/pip install -c $(LOCK) torch
	$(BIN)/pip install -c $(LOCK) -e .

install-dev: $(BIN)/python
	$(BIN)/pip install -c $(LOCK) torch
	$(BIN)/pip install -c $(LOCK) -e '.[dev]'

# the prometheus extra: the demo's report reads the judge server's per-rubric figures from /metrics
demo: install
	$(BIN)/pip install -c $(LOCK) -e '.[prometheus]'
	$(BIN)/calibrl demo

demo-quick: install
	$(BIN)/pip install -c $(LOCK) -e '.[prometheus]'
	$(BIN)/calibrl demo --quick

test: install-dev
	$(BIN)/python -m pytest -ra

test-fast: install-dev
	$(BIN)/python -m pytest -ra -m "not slow"

# Float results must not depend on the CPU: the same tests with ATen's scalar kernels
# (no AVX2 / AVX-512), as CI runs them after `make test`.
test-numerics: install-dev
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -ra $(NUMERICS_TESTS)

# A fresh resolution of '.[dev]' + the locked torch into requirements/lock.txt.
lock: $(BIN)/python
	$(BIN)/python scripts/lock.py

proto: install-dev
	$(BIN)/python scripts/gen_proto.py
