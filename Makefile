# Quick start: `make run` (install + generate with the bundled model), `make test` (install + tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The tide comes in and

.PHONY: install run test lint

$(BIN)/.tidal-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(BIN)/.tidal-installed

run: install
	$(BIN)/tidal generate "$(PROMPT)" --max-tokens 64

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check tidal tests
