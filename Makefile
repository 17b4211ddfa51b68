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

# mypy (half a minute on one core) runs beside pytest, which mostly keeps one core busy. Its report is
# printed only when it finds something, so pytest's summary stays the last line of a green run.
test: lint
	@echo "mypy kvtune runs beside pytest; its report follows pytest's only if it finds a problem"
	$(BIN)/mypy kvtune > $(VENV)/mypy.log 2>&1 & typecheck=$$!; \
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS); unit=$$?; \
	if ! wait $$typecheck; then cat $(VENV)/mypy.log; exit 1; fi; \
	exit $$unit

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
