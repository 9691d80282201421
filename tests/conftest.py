"""Shared pytest setup: deterministic threads, skip reasons for the gpu tier, and the `unit` marker.

The tiers are folders (README, "Tests"): tests/unit (in-process, no process started: `make
test-fast`), tests/distributed (gloo ranks and fresh interpreters), tests/tools (scripts and
benchmarks), tests/e2e (runs of pretrain_rl.py), tests/vllm (a real vLLM server), tests/gpu (CUDA).
Every test under tests/unit is marked `unit` here, so that one pytest call can select the unit tier
plus marked tests of the others (lane 2: `-m "unit or mcore_api"`, see the Makefile).
"""
import os
from pathlib import Path

import pytest
import torch

# megatron's jit_fuser is torch.compile: minutes of CPU compiles for the CPU-lane tests. The GPU
# tests turn it back on where they run what a GPU run compiles (tests/gpu/runs.py, the log-prob tests).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA; this machine has no GPU"))
        if UNIT in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.unit)
