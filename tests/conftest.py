"""Shared pytest setup: deterministic threads, skip reasons for the gpu tier, and the `unit` marker.

The tiers are folders (README, "Tests"): tests/unit (in-process, no process started: `make
test-fast`), tests/distributed (gloo ranks and fresh interpreters), tests/tools (scripts and
benchmarks), tests/e2e (runs of pretrain_rl.py), tests/vllm (a real vLLM server), tests/gpu (CUDA).
Every test under tests/unit is marked `unit` here, so that one pytest call can select the unit tier
plus marked tests of the others (lane 2: `-m "unit or mcore_api"`, see the Makefile).

Parallel runs (`make test`: `pytest -n 2 --dist loadfile`, pytest-xdist). Most tests here run one
thread: a drill's pretrain_rl.py, a single gloo rank, a probe. On 2 cores two workers then finish
the tiers in about half the time. Files go to the workers longest first (tests/order.py). A file's
tests share one worker, so its module fixtures (a
finished run, a random checkpoint) are made once. Two vLLM servers may run at once, one per worker:
the tier's restart and hang detection are triggered by events (a killed or stopped process), not by
how fast a shared machine answers. (xdist's `loadgroup`, which could keep the whole tier on one
worker, groups nothing under pytest 9: xdist 3.8 renames `item._nodeid`, which pytest 9 no longer
reads.)
"""
import os
from pathlib import Path

import pytest
import torch

from tests.order import longest_first

# megatron's jit_fuser is torch.compile: minutes of CPU compiles for the CPU-lane tests. The GPU
# tests turn it back on where they run what a GPU run compiles (tests/gpu/runs.py, the log-prob tests).
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

TESTS = Path(__file__).resolve().parent
UNIT = TESTS / "unit"


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA; this machine has no GPU"))
        path = Path(item.fspath).resolve()
        if UNIT in path.parents:
            item.add_marker(pytest.mark.unit)
    order = longest_first([Path(item.fspath).resolve().relative_to(TESTS).as_posix() for item in items])
    items[:] = [items[i] for i in order]
