# Quick start and checks. Every target is idempotent: setup installs only what is missing.
#   make demo       start the server on the embedded tiny model, send a burst, show the batching
#   make test       run the whole test suite (CPU), as CI does
#   make test-fast  the suite without the end-to-end tests marked slow (servers, whole pipelines)
#   make lint       ruff check + format check
# TORCH_PIP_ARGS passes extra pip arguments for torch, e.g.
#   make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
# A virtual environment keeps the install apart from the system's Python:
#   python -m venv .venv && . .venv/bin/activate && make demo

PYTHON ?= python
PIP := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=

.PHONY: setup demo test test-fast lint format

# pip runs quietly (-q): one line first says what is installing and how long it takes
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
		echo "installing torch $(TORCH_VERSION) (about 2 minutes) ..."; \
		$(PIP) install -q torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS); }
	@$(PYTHON) -c "import importlib.metadata as m; m.version('vllm-omni-step'); \
		import vllm_omni, fastapi, uvicorn, openai, httpx, pytest, ruff, peft, cache_dit" 2>/dev/null || { \
		echo "installing vllm-omni-step and its test dependencies (about 2 minutes) ..."; \
		$(PIP) install -q -e ".[test]"; }

demo: setup
	$(PYTHON) examples/quickstart_demo.py

test: setup
	$(PYTHON) -m pytest -q

test-fast: setup
	$(PYTHON) -m pytest -q -m "not slow"

lint: setup
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

format: setup
	$(PYTHON) -m ruff format .
	$(PYTHON) -m ruff check --fix .
