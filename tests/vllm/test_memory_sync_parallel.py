"""In-memory weight sync from a model-parallel trainer into the real CPU vLLM server: a TP=2 dense
and an EP=2 MoE megatron model, two gloo ranks (tests/spawn.py), pushed by the `memory`
transport as a run does it (trainer/transport.py: every rank exports, rank 0 streams into the
engine it holds). The server's greedy outputs and log-probs then equal those of a server loaded
from disk with the same weights (the export gathered to rank 0 and written as an HF folder):
reloaded in place for the dense model, started on the folder for MoE (vLLM's CPU MoE cannot
reload in place from disk). Two server starts per model, one at a time."""
import pytest

from tests.spawn import run_ranks

pytestmark = pytest.mark.vllm

PROMPTS = [[4 + (3 * i) % 40, 5 + i % 7, 14, 8 + i % 5] for i in range(4)]


def _memory_then_disk(rank, world, arch_name, sizes, disk_sync, vllm_python, run_dir):
    import torch

    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights, save_hf_checkpoint
    from megatron_rl.rollout.types import SamplingParams
    from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
    from megatron_rl.trainer.transport import MemoryTransport, TransportInputs
    from tests.mcore_setup import setup_parallel
    from tests.vllm.conftest import tiny_arch

    groups = setup_parallel(**sizes)
    arch = tiny_arch(arch_name)

    class Policy:  # what the transport reads of trainer/policy.py's Policy
        def __init__(self, seed):
            self.model = build_gpt_model(arch, groups, BuildOptions(seed=seed))

        def export(self, dtype=None, to="all"):
            return export_hf_weights(self.model, arch, groups, dtype=dtype, to=to)

    def engine(**cfg):
        if rank != 0:
            return None
        return VllmEngine(arch, VllmConfig(python=vllm_python, dtype="float32", max_num_seqs=8, max_model_len=128,
                                           health_timeout_s=60.0, **cfg), f"{run_dir}/{cfg.get('weight_sync', 'memory')}")

    def greedy(eng):
        out = eng.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_tokens=12))
        return [(g[0].response_ids, g[0].rollout_logprobs) for g in out]

    first, second = Policy(seed=1), Policy(seed=2)
    transport = MemoryTransport(TransportInputs(groups, arch, run_dir))
    memory = engine()
    try:
        transport.push(first, memory, 0)
        transport.push(second, memory, 1)   # a second sync, in place
        memory_out = greedy(memory) if rank == 0 else None
        probe = memory.stats()["vllm/probe_max_abs_diff"] if rank == 0 else None
    finally:
        if memory is not None:
            memory.close()
    folder = f"{run_dir}/hf"
    named = second.export(to=0)   # collective: rank 0 gets every tensor
    if rank == 0:
        save_hf_checkpoint(folder, arch, named)
    else:
        for _ in named:
            pass
    if rank != 0:
        return None
    disk = engine(weight_sync=disk_sync)
    try:
        disk.load_weights_from(folder, 1)   # the server starts on the folder
        disk_out = greedy(disk)
    finally:
        disk.close()
    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(memory_out, disk_out))
    return {"same": same, "probe": probe, "memory": memory_out, "disk": disk_out}


@pytest.mark.parametrize("arch_name,sizes,disk_sync", [
    ("qwen3", {"tensor_model_parallel_size": 2}, "reload"),
    ("qwen3_moe", {"expert_model_parallel_size": 2}, "restart"),
], ids=["dense_tp2", "moe_ep2"])
def test_model_parallel_trainer_syncs_in_memory_as_from_disk(arch_name, sizes, disk_sync, vllm_python, tmp_path):
    r0, _ = run_ranks(_memory_then_disk, world_size=2, timeout=1500, arch_name=arch_name, sizes=sizes,
                      disk_sync=disk_sync, vllm_python=vllm_python, run_dir=str(tmp_path))
    assert r0["probe"] < 1e-5
    assert r0["same"], (r0["memory"], r0["disk"])
