# Quick start and checks. Every target is idempotent: setup installs only what is missing.
#   make demo   start the server on the embedded tiny model, send a burst, show the batching
#   make test   run the whole test suite (CPU)
#   make lint   ruff check + format check
# TORCH_PIP_ARGS passes extra pip arguments for torch, e.g.
#   make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"

PYTHON ?= python
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=

.PHONY: setup demo test lint format

setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	@$(PYTHON) -c "import importlib.metadata as m; m.version('vllm-omni-step'); \
		import vllm_omni, fastapi, uvicorn, openai, httpx, pytest, ruff" 2>/dev/null \
		|| $(PIP) install -q -e ".[test]"

demo: setup
	$(PYTHON) examples/quickstart_demo.py

test: setup
	$(PYTHON) -m pytest -q

lint: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format: setup
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .
