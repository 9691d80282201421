"""In-memory weight sync into the real CPU vLLM server (rollout.vllm.weight_sync=memory): after
the weights are streamed over gloo, greedy outputs and their log-probs are exactly those the same
server gives after loading the same weights from disk, for a MoE model (a fresh start from the
folder: vLLM's CPU MoE cannot reload in place from disk). It also proves the experts are
repacked: it syncs three times without a restart. The dense model's case (disk: the first load and
a reload in place) is test_server.py's test_memory_sync_equals_disk_loads, on that module's server.

Each server start costs 30-170 s on a loaded 2-core machine: two here (the in-memory one, then the
disk reference)."""
import pytest
import torch

from megatron_rl.model.hf_io import SafetensorsReader
from megatron_rl.model.parity import random_hf_model
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
from tests.vllm.conftest import ONE_PROCESS_ENGINE, tiny_arch

pytestmark = pytest.mark.vllm

PROMPTS = [[4 + (3 * i) % 40, 5 + i % 7, 14, 8 + i % 5] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def checkpoint_weights(arch, seed: int, path) -> list:
    """HF checkpoint-format (name, tensor) pairs, as export_hf_weights yields them (experts one by
    one), written to `path` too: the disk side of the comparison."""
    random_hf_model(arch, seed=seed).save_pretrained(path)
    read = SafetensorsReader(str(path))
    return [(name, read(name)) for name in read.keys()]  # noqa: SIM118 - a reader, not a dict


def greedy(engine):
    out = engine.generate(PROMPTS, 1, GREEDY)
    return [(g[0].response_ids, g[0].rollout_logprobs) for g in out]


def assert_same(memory, disk):
    for (ids_m, lp_m), (ids_d, lp_d) in zip(memory, disk):
        assert torch.equal(ids_m, ids_d)
        assert torch.equal(lp_m, lp_d), float((lp_m - lp_d).abs().max())


def engine(arch, vllm_python, run_dir, **overrides):
    cfg = VllmConfig(python=vllm_python, dtype="float32", max_num_seqs=8, max_model_len=128, health_timeout_s=60.0,
                     env=ONE_PROCESS_ENGINE, **overrides)
    return VllmEngine(arch, cfg, str(run_dir))


def run(eng, syncs):
    """Each sync in turn, with the greedy outputs after each; then the engine's stats. The
    server is stopped after (one server at a time on this machine)."""
    try:
        outs = []
        for sync in syncs:
            sync(eng)
            outs.append(greedy(eng))
        return outs, eng.stats()
    finally:
        eng.close()


def test_moe_memory_sync_equals_a_fresh_load_from_disk(vllm_python, tmp_path):
    arch = tiny_arch("qwen3_moe")
    a = checkpoint_weights(arch, 0, tmp_path / "a")
    b = checkpoint_weights(arch, 1, tmp_path / "b")
    # b, a, b: the experts prepacked at the start (random) and at each sync are replaced, no restart
    outs, stats = run(engine(arch, vllm_python, tmp_path / "memory"),
                      [lambda e: e.update_weights(b, 0), lambda e: e.update_weights(a, 1),
                       lambda e: e.update_weights(b, 2)])
    assert stats["vllm/probe_max_abs_diff"] < 1e-5 and stats["vllm/restarts"] == 0
    assert stats["vllm/weight_syncs"] == 3
    assert any(not torch.equal(x[0], y[0]) for x, y in zip(outs[1], outs[2]))
    # the disk side: vLLM's CPU MoE cannot reload in place from a folder, so a start on it
    (disk_b,), _ = run(engine(arch, vllm_python, tmp_path / "disk", weight_sync="restart"),
                       [lambda e: e.load_weights_from(str(tmp_path / "b"), 0)])
    assert_same(outs[0], disk_b)
    assert_same(outs[2], disk_b)
    print(f"\nMoE in-memory sync: {stats['timing/vllm_memory_sync']:.3f} s, no restart")
