# tokenbus: `make run` starts the embedded stack, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test bench faults setup clean

run: setup
	$(BIN)/tokenbus up

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench

# Fault injection at full strength: the crash-takeover case ten times over.
faults: setup
	TOKENBUS_TAKEOVER_RUNS=10 $(BIN)/python -m pytest -q tests/gpu_consumers/test_crash_takeover.py

setup: $(STAMP)

# Reinstall only when the package metadata changes; a fresh machine has only Python and pip.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/tokenbus doctor --install
	touch $(STAMP)

clean:
	rm -rf $(VENV) .run .pytest_cache bench/results
