# Every target bootstraps .venv itself, so a fresh clone needs nothing but python3 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# C++ sources compiled for this CPU: the attention kernel and the benchmarks' probes.
KERNEL_SOURCES := kvtune/kernels/csrc/paged_attention_cpu.cpp kvtune/bench/csrc/kernel_probes.cpp

.PHONY: demo test lint typecheck unit clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# The kernels compile (minutes, one core each) while pip installs; the build needs only the stdlib.
	PYTHONPATH=. $(BIN)/python kvtune/kernels/cpu_build.py $(KERNEL_SOURCES) & build=$$!; \
	$(BIN)/python -m pip install --quiet --upgrade pip && \
	$(BIN)/python -m pip install --quiet -e '.[dev,engine]' && wait $$build
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
