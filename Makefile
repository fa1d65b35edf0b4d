# Every target bootstraps .venv when it is missing or pyproject.toml changed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fairgate demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check gateway policies loadtest tests
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/fairgate bench all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
