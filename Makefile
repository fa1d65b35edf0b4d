# Every target bootstraps .venv when it is missing or pyproject.toml changed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8000
# make bench SCENARIO=newcomer ARGS=--quick  (fairgate bench SCENARIO ARGS)
SCENARIO ?= all
ARGS ?=

.PHONY: run try test test-fast test-deps lint bench clean

$(STAMP): pyproject.toml
	@echo "installing fairgate[dev] into $(VENV) (once per pyproject.toml change, about a minute)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fairgate demo --port $(PORT)

# one chat request with the openai SDK to the demo that `make run` started
try: $(STAMP)
	$(BIN)/python scripts/try.py --port $(PORT)

# promtool, chromium and chromedriver from Debian (apt-get as root; otherwise says what to install)
test-deps:
	bash scripts/test-deps.sh

# two workers (TEST_WORKERS=0: one process); one of them runs the real-vLLM tier and then
# the benchmark smoke tests, so no benchmark runs beside a vLLM engine (tests/conftest.py)
TEST_WORKERS ?= 2
test: test-deps $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=25

# the fast tiers alone (no chaos, bench, fuzz or real-vLLM tier): a few minutes
test-fast: test-deps $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"

# lint-imports: the layering of docs/architecture.md ([tool.importlinter] in pyproject.toml)
lint: $(STAMP)
	$(BIN)/ruff check gateway policies loadtest tests
	$(BIN)/mypy
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/fairgate bench $(SCENARIO) $(ARGS)

clean:
	rm -rf $(VENV) .venv-vllm .fairgate test-artifacts results build *.egg-info \
		.pytest_cache .mypy_cache .ruff_cache .import_linter_cache .hypothesis .schemathesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
