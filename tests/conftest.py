"""Shared pytest setup: deterministic threads, skip reasons for the gpu tier, and the `unit` marker.

The tiers are folders (README, "Tests"): tests/unit (in-process, no process started: `make
test-fast`), tests/distributed (gloo ranks and fresh interpreters), tests/tools (scripts and
benchmarks), tests/e2e (runs of pretrain_rl.py), tests/vllm (a real vLLM server), tests/gpu (CUDA).
Every test under tests/unit is marked `unit` here, so that one pytest call can select the unit tier
plus marked tests of the others (lane 2: `-m "unit or mcore_api"`, see the Makefile).

Parallel runs (`make test`: `pytest -n 2 --dist loadgroup`, pytest-xdist). Most tests here run one
thread: a drill's pretrain_rl.py, a single gloo rank, a probe. On 2 cores two workers then finish
the tiers in about half the time. Each test is put in the xdist group of its file, so a file's tests
share one worker and its module fixtures (a finished run, a random checkpoint) are made once; the
whole vLLM tier is one group, so at most one real vLLM server runs at a time (a server takes every
core it is given, and the tier's restart and hang detection are about the server, not about a
machine shared with a second one).
"""
import os
from pathlib import Path

import pytest
import torch

# megatron's jit_fuser is torch.compile: minutes of CPU compiles for the CPU-lane tests. The GPU
# tests turn it back on where they run what a GPU run compiles (tests/gpu/runs.py, the log-prob tests).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

TESTS = Path(__file__).resolve().parent
UNIT, VLLM = TESTS / "unit", TESTS / "vllm"


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA; this machine has no GPU"))
        path = Path(item.fspath).resolve()
        if UNIT in path.parents:
            item.add_marker(pytest.mark.unit)
        group = "vllm" if VLLM in path.parents else str(path.relative_to(TESTS))
        item.add_marker(pytest.mark.xdist_group(group))
