# Every target bootstraps .venv itself, so a fresh clone needs nothing but python3 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,engine]'
	$(BIN)/python -m kvtune.kernels.cpu_build
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtune demo

lint: $(STAMP)
	$(BIN)/ruff check kvtune tests
	$(BIN)/ruff format --check kvtune tests
	$(BIN)/lint-imports --no-cache

typecheck: $(STAMP)
	$(BIN)/mypy kvtune

unit: $(STAMP)
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

test: lint typecheck unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
