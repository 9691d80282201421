"""benchmarks/weight_sync.py drives the engine's public sync calls: `memory` streams tensors
(update_weights), `reload` / `restart` write a folder and hand it over (load_weights_from). No
server is started here (the engine starts one on its first weights); the benchmark's real runs
are in benchmarks/results/weight_sync_cpu.md."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import weight_sync as bench

from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from tests.vllm.conftest import tiny_arch


@pytest.mark.parametrize(("kind", "call"), [("memory", "update_weights"), ("reload", "load_weights_from"),
                                            ("restart", "load_weights_from")])
def test_each_sync_kind_uses_its_engine_call(tmp_path, monkeypatch, kind, call):
    engine = VllmEngine(tiny_arch(), VllmConfig(weight_sync=kind, dtype="float32"), str(tmp_path))
    calls = []
    monkeypatch.setattr(engine, "update_weights", lambda named, version: calls.append(("update_weights", version)))
    monkeypatch.setattr(engine, "load_weights_from", lambda path, version: calls.append(("load_weights_from", version)))
    monkeypatch.setattr(bench.DiskTransport, "write", lambda self, named, version: str(tmp_path / f"v{version}"))
    bench.sync_fn(engine, [], 3, str(tmp_path))()
    assert calls == [(call, 3)]
