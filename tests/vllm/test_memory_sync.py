"""In-memory weight sync from a model-parallel trainer into the real CPU vLLM server: a TP=2 dense
and an EP=2 MoE megatron model, two gloo ranks (tests/spawn.py), pushed by the `memory`
transport as a run does it (trainer/transport.py: every rank exports, rank 0 streams into the
engine it holds). The server's greedy outputs and log-probs then equal those the same server gives
after a single-rank in-memory sync of the same weights (the export gathered to rank 0 and pushed
as (name, tensor) pairs): the parallel export and stream change nothing. The single-rank sync in
turn equals a load from disk: for the dense model test_server.py's test_memory_sync_equals_disk_loads
(a first load and a reload in place); for the MoE model here, a fresh server started on the gathered
weights written as a folder (vLLM's CPU MoE cannot reload in place from disk), after three syncs
without a restart into the in-memory one (the experts are repacked at each). One server start per
model, and one more for the MoE's disk side."""
import pytest

from tests.spawn import run_ranks

pytestmark = pytest.mark.vllm

PROMPTS = [[4 + (3 * i) % 40, 5 + i % 7, 14, 8 + i % 5] for i in range(4)]


def _parallel_then_single(rank, world, arch_name, sizes, vllm_python, run_dir, folder):
    import torch

    from megatron_rl.model import BuildOptions, build_gpt_model
    from megatron_rl.model.hf_io import export_hf_weights, save_hf_checkpoint
    from megatron_rl.rollout.types import SamplingParams
    from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
    from megatron_rl.trainer.transport import MemoryTransport, TransportInputs
    from tests.mcore_setup import setup_parallel
    from tests.vllm.conftest import ONE_PROCESS_ENGINE, tiny_arch

    groups = setup_parallel(**sizes)
    arch = tiny_arch(arch_name)

    class Policy:  # what the transport reads of trainer/policy.py's Policy
        def __init__(self, seed):
            self.model = build_gpt_model(arch, groups, BuildOptions(seed=seed))

        def export(self, dtype=None, to="all"):
            return export_hf_weights(self.model, arch, groups, dtype=dtype, to=to)

    def greedy(eng):
        out = eng.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_tokens=12))
        return [(g[0].response_ids, g[0].rollout_logprobs) for g in out]

    def same(a, b):
        return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))

    first, second = Policy(seed=1), Policy(seed=2)
    gathered = list(second.export(to=0))   # collective: rank 0 gets every tensor
    if rank == 0 and folder:
        save_hf_checkpoint(folder, arch, gathered)  # the disk side of the comparison
    transport = MemoryTransport(TransportInputs(groups, arch, run_dir))
    engine = None
    if rank == 0:
        engine = VllmEngine(arch, VllmConfig(python=vllm_python, dtype="float32", max_num_seqs=8, max_model_len=128,
                                             health_timeout_s=60.0, env=ONE_PROCESS_ENGINE), f"{run_dir}/memory")
    try:
        if rank == 0:
            engine.update_weights(gathered, 0)   # single-rank: the reference (== a load from disk)
            single = greedy(engine)
        transport.push(first, engine, 1)
        first_out = greedy(engine) if rank == 0 else None
        transport.push(second, engine, 2)   # a second sync, in place
        if rank != 0:
            return None
        parallel = greedy(engine)
        stats = engine.stats()
    finally:
        if engine is not None:
            engine.close()
    return {"same": same(parallel, single), "first_differs": not same(first_out, single),
            "probe": stats["vllm/probe_max_abs_diff"], "restarts": stats["vllm/restarts"],
            "syncs": stats["vllm/weight_syncs"], "parallel": parallel, "single": single}


def _greedy_from_disk(arch_name, vllm_python, folder, run_dir):
    """Greedy outputs and log-probs of a server started on `folder` (the module's configuration
    but the sync: vLLM's CPU MoE cannot reload in place from disk, so a start on it)."""
    from megatron_rl.rollout.types import SamplingParams
    from megatron_rl.rollout.vllm import VllmConfig, VllmEngine
    from tests.vllm.conftest import ONE_PROCESS_ENGINE, tiny_arch

    engine = VllmEngine(tiny_arch(arch_name), VllmConfig(python=vllm_python, dtype="float32", max_num_seqs=8,
                                                         max_model_len=128, health_timeout_s=60.0,
                                                         env=ONE_PROCESS_ENGINE), run_dir, weight_sync="restart")
    try:
        engine.load_weights_from(folder, 0)
        out = engine.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_tokens=12))
    finally:
        engine.close()
    return [(g[0].response_ids, g[0].rollout_logprobs) for g in out]


@pytest.mark.parametrize("arch_name,sizes,disk", [
    ("qwen3", {"tensor_model_parallel_size": 2}, False),  # the disk side: test_server.py
    ("qwen3_moe", {"expert_model_parallel_size": 2}, True),
], ids=["dense_tp2", "moe_ep2"])
def test_model_parallel_trainer_syncs_in_memory_as_a_single_rank(arch_name, sizes, disk, vllm_python, tmp_path):
    import torch

    folder = str(tmp_path / "disk_weights") if disk else None
    r0, _ = run_ranks(_parallel_then_single, world_size=2, timeout=1500, arch_name=arch_name, sizes=sizes,
                      vllm_python=vllm_python, run_dir=str(tmp_path), folder=folder)
    assert r0["probe"] < 1e-5 and r0["restarts"] == 0 and r0["syncs"] == 3  # three syncs, no restart
    assert r0["first_differs"]  # the parallel syncs replaced the weights: the equality below is theirs
    assert r0["same"], (r0["parallel"], r0["single"])
    if disk:  # the single-rank in-memory sync (and so the parallel ones) equals a fresh load from disk
        for (ids_m, lp_m), (ids_d, lp_d) in zip(r0["single"], _greedy_from_disk(arch_name, vllm_python, folder,
                                                                                 str(tmp_path / "disk"))):
            assert torch.equal(ids_m, ids_d)
            assert torch.equal(lp_m, lp_d), float((lp_m - lp_d).abs().max())
