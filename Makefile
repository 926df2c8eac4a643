# Two commands matter: `make up` (the fleet, with the tiny offline demo model) and
# `make test` (the whole suite). Both create .venv and install what they need first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm

.PHONY: install up test chaos bench clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml Makefile shared/torchvision_guard.py
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python 3.11) on PATH"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m shared.torchvision_guard --install
	touch $(STAMP)

up: install
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/mmfleet up

# the test suite also runs the vLLM engine (parity in modes epd and e-pd): install that extra
$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,vllm]'
	$(BIN)/python -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m shared.torchvision_guard --install
	touch $(VLLM_STAMP)

# lint first (pyflakes, import order, pycodestyle; [tool.ruff] in pyproject.toml): seconds, not minutes
test: install $(VLLM_STAMP)
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# a short standard benchmark suite (a few minutes); results under loadtest/results/<time>/
bench: install
	$(BIN)/python -m pip install -q -e '.[bench]'
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest suite $(BENCH_ARGS)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest kv $(KV_BENCH_ARGS)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest reuse $(BENCH_ARGS)

# the long chaos run: 200 requests while each stage's worker is killed in turn
chaos: install
	CHAOS_REQUESTS=200 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/chaos -s $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
