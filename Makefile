# Two entry points: `make run` starts the gateway in front of 4 emulated replicas,
# `make test` runs lint, types and the whole test suite. Both create .venv on first use.
# `make test-fast` runs the tests that need no real engine and start no fleet of gateways.
# `make run-real` puts it in front of two real vLLM replicas (CPU build, tiny model), installing
# vLLM into ~/.cache/prefix-gateway on first use (minutes, ~3.5 GB): see docs/real-engines.md.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Two stamps: the runtime alone (what `make run` needs), and the test extra on top of it.
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

.PHONY: run run-real test test-fast lint install engines bytecode

# The suite's modules on several workers, one per core: more starve the processes the tests
# start (deadlines of Redis calls, health probes) on a busy machine. The tests marked `alone`,
# which learn from the replicas' timing, run after them by themselves; then the real engines,
# on their own: an engine decoding takes a core, and beside it the others' deadlines fail.
# The modules sharing the real pair take one worker, those with engines of their own the other.
TEST_WORKERS ?= 2
PARALLEL := -n $(TEST_WORKERS) --dist loadscope

$(RUNTIME_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(RUNTIME_STAMP)
	$(BIN)/prefix-gateway serve --host 127.0.0.1 --port 8080 --emulate 4 --log-format text

run-real: $(RUNTIME_STAMP)
	$(BIN)/python -m engines.fleet --port 8080

# vLLM's CPU build in ~/.cache/prefix-gateway (one for every checkout), for run-real and the
# real_vllm tests (stamped: once).
engines: $(RUNTIME_STAMP)
	$(BIN)/python -m engines.venv

# mypy's cache in the user's cache, one per set of options: a fresh clone checks in seconds
# what it would take a minute to check cold (mypy compares each file's hash, not its path).
MYPY_CACHE ?= $(HOME)/.cache/prefix-gateway/mypy

lint: $(STAMP)
	$(BIN)/ruff check prefix_gateway tests loadtest engines scripts
	$(BIN)/mypy --cache-dir $(MYPY_CACHE)/checked prefix_gateway tests loadtest
	$(BIN)/mypy --cache-dir $(MYPY_CACHE)/strict --strict engines scripts
	$(BIN)/lint-imports

# vLLM's CPU build is installed unless SKIP_REAL_VLLM=1, which also skips its tests; the
# checks run while it installs (one mostly waits on the disk, the other on a core).
SKIP_REAL_VLLM ?= 0
BEFORE_TESTS := lint $(if $(filter 1,$(SKIP_REAL_VLLM)),,engines)
# The package's bytecode written once before the tests: where PYTHONDONTWRITEBYTECODE is set,
# every process a test starts would otherwise compile what the test process never imported.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q prefix_gateway

test: $(STAMP) bytecode
	scripts/test-tools
	@$(MAKE) --no-print-directory -j2 $(BEFORE_TESTS)
	$(BIN)/pytest $(PARALLEL) -m "not real_vllm and not alone"
	$(BIN)/pytest -m alone
	$(BIN)/pytest $(PARALLEL) -m real_vllm

test-fast: $(STAMP) bytecode
	scripts/test-tools
	$(BIN)/pytest $(PARALLEL) -m "not real_vllm and not fleet and not slow"
