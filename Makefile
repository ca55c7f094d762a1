# The two commands of the README. Each creates its own virtualenv (.venv) on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: up test lint proto

up: $(VENV)/.installed
	$(BIN)/meshca up $(UP_ARGS)

test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

# Regenerates proto/meshca_proto/*_pb2*.py from ca.proto (CI fails if they are stale).
proto: $(VENV)/.installed-test
	PYTHON=$(BIN)/python proto/generate.sh

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/bin/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(VENV)/.installed
