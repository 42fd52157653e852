# Two commands do all the set-up on a fresh machine: `make serve` and `make test` (`make help` lists every target).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
# Axolotl's KD dataset loader, read back by tests/test_capture_formats.py: installed without its dependencies (they
# pin another transformers; those its loader imports are in the test extra) into a folder of its own, outside
# site-packages, so pip does not count it and `pip check` stays clean (the test puts the folder on sys.path).
AXOLOTL := $(VENV)/axolotl-no-deps
# CPU torch first: with no torch present an unpinned install would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: help install serve test docs load-test bench bench-batching bench-groups bench-http gpu-wheels gpu-check-dry
help:  ## this list: every target and what it does
	@grep -E '^[a-z][a-z-]*:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):[^#]*## */\1\t/' | \
		awk -F '\t' '{ printf "  make %-16s %s\n", $$1, $$2 }'

# What serving needs: torch, then logitserve with its server extra (`make serve`).
$(SERVE_STAMP): pyproject.toml setup.py proto/logitserve/v1/logitserve.proto
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e ".[server]"
	touch $(SERVE_STAMP)

# What the tests need besides: the test extra and Axolotl's loader (`make test`, `make install`).
$(STAMP): $(SERVE_STAMP)
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps --upgrade --target $(AXOLOTL) "axolotl==0.19.0"
	touch $(STAMP)

install: $(STAMP)  ## the virtual environment the tests need (.venv), without running anything

HTTP_PORT ?= 8000
serve: $(SERVE_STAMP)  ## installs what serving needs, serves the demo: gRPC on 50051, HTTP on 8000 (HTTP_PORT= none); ARGS="--demo reward" etc.
	$(BIN)/logitserve serve $(if $(HTTP_PORT),--http-port $(HTTP_PORT)) $(ARGS)

test: $(STAMP)   ## the whole suite
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

docs: $(STAMP)  ## the documentation site into site/ (mkdocs-material); tests/test_docs.py builds it --strict
	$(BIN)/python docs/gen_reference.py && $(BIN)/mkdocs build --strict

load-test: $(STAMP)  ## the full load test: 64 streams for 60 s
	$(BIN)/python -m pytest -q -s -m slow tests/test_load.py

bench: $(STAMP)  ## the benchmark: writes bench/results/*.json and prints a markdown table
	$(BIN)/python bench/run.py $(ARGS)

bench-batching: $(STAMP)  ## throughput by batch shape (demo and body-heavy models; packed vs exact vs the floor)
	$(BIN)/python bench/batching.py $(ARGS)

bench-groups: $(STAMP)  ## RL-shaped groups: prompt_lengths and shared prompts vs the in-process floor
	$(BIN)/python bench/groups.py $(ARGS)

bench-http: $(STAMP)  ## the HTTP routes against vLLM's server on the same /v1/completions body (k=20, k=100)
	$(BIN)/python bench/http_peer.py $(ARGS)

gpu-wheels: $(STAMP)  ## the wheels bench/gpu_check.sh installs on the lent GPU machine (cp312 manylinux) into .whl/
	PYTHON=$(BIN)/python bash bench/gpu_wheels.sh .whl 3.12

gpu-check-dry: $(STAMP)  ## bench/gpu_check.sh's steps here on the CPU (what CI runs in tests/test_gpu_check.py)
	PYTHON=$(BIN)/python bash bench/gpu_check.sh --dry-run
