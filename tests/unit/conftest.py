"""The unit tier starts no process: a test here that tries fails with where it belongs instead.

`make test-fast` runs this tier on every edit, so it must stay minutes on 2 cores: an interpreter
start with torch and megatron-core costs seconds, a server or a training run far more. Tests that
start gloo ranks or fresh interpreters live in tests/distributed, tests of scripts and benchmarks
(tools/, benchmarks/, examples/) in tests/tools, runs of pretrain_rl.py in tests/e2e.
"""
import multiprocessing.process
import os
import subprocess

import pytest

WHERE = ("a unit test starts no process: move it to tests/distributed (ranks, fresh interpreters) or "
         "tests/tools (scripts and benchmarks)")


def _refuse(*args, **kwargs):
    raise AssertionError(WHERE)


@pytest.fixture(scope="session", autouse=True)
def _imports_that_start_processes():
    """Imports that start a process of their own, done once before the guard below: matplotlib
    lists the system's fonts (fc-list) the first time it is imported on a machine and caches them;
    megatron-core 0.19 asks git for its commit (package_info.py) when first imported."""
    import matplotlib.font_manager  # noqa: F401
    import megatron.core  # noqa: F401


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch, _imports_that_start_processes):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse)
