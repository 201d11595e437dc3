# Two commands on a fresh machine with Python 3.11 and make:
#   make demo   -- creates .venv, installs jaxcache, trains DLRM through the cache
#   make test   -- installs the test tools, runs ruff, mypy and the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[datasets,examples,test,docs]"
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python examples/dlrm.py

lint: $(VENV)/.installed
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: $(VENV)/.installed
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -n 2 -q

docs: $(VENV)/.installed
	$(BIN)/sphinx-build -W -b html docs docs/_build/html

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) docs/_build .pytest_cache .ruff_cache .mypy_cache
