"""Shared pytest setup: deterministic threads, and skip reasons for the vllm and gpu tiers."""
import os

import pytest
import torch

# megatron's jit_fuser is torch.compile: minutes of CPU compiles for the CPU-lane tests. The GPU
# tests turn it back on where they run what a GPU run compiles (tests/gpu/runs.py, the log-prob tests).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA; this machine has no GPU"))
