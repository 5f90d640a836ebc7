# jax_scaled developer commands. Needs GNU make, python3 (>= 3.11) with venv, and PyPI access.
#
#   make demo    digits MLP (fp32 / raw fp16 / scalified fp16), then a small GPT in four of
#                Table 3's precisions (experiments/digits.py, experiments/table3.py --demo)
#   make test    ruff, the test suite (2 workers) and the docstring examples
#   make bench   scalify overhead benchmark (benchmarks/overhead.py; BENCH_ARGS=--reps 10 ...)
#   make lint    ruff check only
#
# Dependencies are installed into .venv once per change of pyproject.toml (stamp files in .venv).

SHELL := bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
LINT_PATHS := jax_scaled tests benchmarks experiments
PYTEST_WORKERS ?= 2
DEMO_ARGS ?= --check 1.0
TABLE3_DEMO_ARGS ?= --demo
BENCH_ARGS ?=

.PHONY: help venv demo test lint doctest bench clean

help:
	@sed -n '1,10p' Makefile | sed 's/^# \{0,1\}//'

# --- environment ------------------------------------------------------------------------

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

$(VENV): $(PY)

venv: $(PY)

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PIP) install -e '.[test]'
	touch $@

$(VENV)/.installed-experiments: pyproject.toml | $(PY)
	$(PIP) install -e '.[experiments]'
	touch $@

# --- targets ------------------------------------------------------------------------------

demo: $(VENV)/.installed-experiments
	$(PY) -m experiments.digits $(DEMO_ARGS)
	$(PY) -m experiments.table3 $(TABLE3_DEMO_ARGS)

lint: $(VENV)/.installed-test
	$(PY) -m ruff check $(LINT_PATHS)

test: lint $(VENV)/.installed-test
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal tests
	$(MAKE) --no-print-directory doctest

# Docstring examples; their names (jax, jnp, np, js, the public API) come from ./conftest.py.
doctest: $(VENV)/.installed-test
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist worksteal --doctest-modules jax_scaled

bench: $(VENV)/.installed-test
	$(PY) benchmarks/overhead.py $(BENCH_ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -not -path './$(VENV)/*' -prune -exec rm -rf {} +
