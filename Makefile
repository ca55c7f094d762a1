# The two commands of the README. Each creates its own virtualenv (.venv) on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# Test processes run side by side (pytest-xdist), one file per worker so a module's fixtures
# start once; 0 runs the suite in this process.
PYTEST_WORKERS ?= 2
# The CA's wire tests, run a second time on grpc.aio's server: the fallback `--rpc-server auto`
# takes when grpcio's completion-queue layer is not the one tested (ca_server/serving/cq_server.py).
AIO_WIRE_TESTS = tests/compat tests/hostile tests/ca_server/test_create_certificate.py \
	tests/ca_server/test_refusals.py

.PHONY: up test lint proto prometheus-tools real-binaries fuzz

up: $(VENV)/.installed
	$(BIN)/meshca up $(UP_ARGS)

test: $(VENV)/.installed-test prometheus-tools real-binaries
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	@echo "the CA wire tests again on the fallback server (--rpc-server aio)"
	MESHCA_TEST_RPC_SERVER=aio $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile \
		$(AIO_WIRE_TESTS) $(PYTEST_ARGS)

lint: $(VENV)/.installed-test
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

# The real kube-apiserver, etcd and pilot-agent of tests/k8s_real, built with Go from the modules
# pinned in tests/realbin into a cache outside the checkout (MESHCA_TEST_BIN_CACHE, default
# ~/.cache/meshca-test-binaries), keyed by version: a warm machine builds nothing.
real-binaries: $(VENV)/.installed-test
	$(BIN)/python -m tests.support.real_binaries

# Optional, not part of `make test`: coverage-guided fuzzing (atheris) of the parsers that face
# the network, FUZZ_SECONDS per target; a crash is saved as fuzz-artifacts/crash-*.
FUZZ_SECONDS ?= 60
fuzz: $(VENV)/.installed-test
	$(BIN)/python -m pip install --quiet -e '.[fuzz]'
	mkdir -p fuzz-artifacts
	for target in csr ca-request token sds; do \
		$(BIN)/python -m tests.fuzz.fuzz_parsers $$target -max_total_time=$(FUZZ_SECONDS) \
			-artifact_prefix=fuzz-artifacts/ || exit 1; \
	done

# Regenerates proto/meshca_proto/*_pb2*.py from the .proto files (CI fails if they are stale).
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

# The monitoring tests run Debian's Prometheus (promtool for the alert rules, a live server for the
# end-to-end test). Installed once, when either binary is missing (CI runs as root).
prometheus-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus package (prometheus, promtool) for the tests"; \
	  apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }
