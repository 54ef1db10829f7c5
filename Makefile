# Two entry points for a fresh machine: `make demo` and `make test` (README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/kvlab: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: setup demo test
setup: $(BIN)/kvlab

demo: setup
	$(BIN)/kvlab plan llama-3.1-70b --context 131072 --users 4 --gpus 8

test: setup
	$(BIN)/pytest
