# Two commands do all the set-up on a fresh machine:
#   make demo   installs into .venv and runs the embedded demo (the main job)
#   make test   installs into .venv (with the dev extra) and runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install install-dev demo demo-quick test test-fast proto bench

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
install: $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e .

install-dev: $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'

demo: install
	$(BIN)/calibrl demo

demo-quick: install
	$(BIN)/calibrl demo --quick

test: install-dev
	$(BIN)/python -m pytest -ra

test-fast: install-dev
	$(BIN)/python -m pytest -ra -m "not slow"

proto: install-dev
	$(BIN)/python scripts/gen_proto.py
