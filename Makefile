# Two entry points: `make run` starts the gateway in front of 4 emulated replicas,
# `make test` runs lint, types and the whole test suite. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/prefix-gateway serve --host 127.0.0.1 --port 8080 --emulate 4

lint: $(STAMP)
	$(BIN)/ruff check gateway tests loadtest
	$(BIN)/mypy gateway
	$(BIN)/lint-imports

test: lint
	scripts/test-tools
	$(BIN)/pytest
