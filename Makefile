# Quick start: `make run` (install + serve the bundled model on 127.0.0.1:8000), `make test`
# (install + tests). `make generate` streams one completion in the terminal instead.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= The tide comes in and

HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install run generate test lint

$(BIN)/.tidal-installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

install: $(BIN)/.tidal-installed

run: install
	$(BIN)/tidal serve --host $(HOST) --port $(PORT)

generate: install
	$(BIN)/tidal generate "$(PROMPT)" --max-tokens 64

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check tidal tests
