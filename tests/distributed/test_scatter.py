"""Rank 0 sends each rank its part of the step's batch (trainer/scatter.py), on two gloo ranks: for
DP, CP, TP, PP and EP layouts every rank receives exactly what `local_shard` keeps of the whole
batch (and the engine's routing of its rows, CP columns and pipeline stage's MoE layers), and no
more; a failure of rank 0's packing reaches both ranks. No model: only megatron's process groups (the trained result under DP=2 equals DP=1
in test_rl_loop.py, which also checks the logged bytes)."""
from tests.spawn import run_ranks

LAYOUTS = {"dp2": {}, "cp2": {"context_parallel_size": 2}, "tp2": {"tensor_model_parallel_size": 2},
           "pp2": {"pipeline_model_parallel_size": 2}, "ep2": {"expert_model_parallel_size": 2}}


def _size(tensors) -> int:
    """Bytes of the tensors among `tensors` (None and other values count nothing)."""
    import torch

    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _failing_prepare():
    raise ValueError("no kept ids")


def _scatter_every_layout(rank, world):
    import dataclasses

    import torch
    import torch.distributed as dist

    from megatron_rl.moe import RolloutRouting
    from megatron_rl.parallel import ParallelConfig, init_parallel
    from megatron_rl.parallel.layout import BatchLayout
    from megatron_rl.platform import apply_platform_workarounds
    from megatron_rl.trainer.batch import build_batch, local_shard, padded_length, row_multiple
    from megatron_rl.trainer.scatter import Prepared, scatter_batch
    from tests.unit.trainer.test_scatter import _samples  # routed experts and kept ids, uneven lengths

    apply_platform_workarounds()
    samples, out = _samples(16), {}
    for name, sizes in LAYOUTS.items():
        config = ParallelConfig(**sizes)
        groups = init_parallel(config)
        # every rank builds the whole batch here only to have the reference; the scatter sends it from rank 0
        full = build_batch(samples, [float(i) for i in range(16)], 0,
                           padded_length(samples, row_multiple(config.tp, config.cp)), with_kept_ids=True)
        full = full.with_advantages(torch.linspace(-1, 1, 16))
        routing = RolloutRouting.from_samples(samples, full.input_len + 1)
        layout = BatchLayout(rows=16, num_minibatches=2, dp=groups.dp_size, micro_batch_size=2)
        prepared = Prepared(full, routing, {"rollout/reward_mean": 7.5})
        layers = [groups.pp_rank] if config.pp == 2 else [0, 1]  # the 2 MoE layers of _samples, by stage
        got = scatter_batch(lambda p=prepared: p, layout, groups, layers)  # only rank 0 calls it
        rows, want = local_shard(full, layout, groups)
        assert torch.equal(got.rows, rows), name
        for f in dataclasses.fields(want):
            a, b = getattr(got.batch, f.name), getattr(want, f.name)
            assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(b, torch.Tensor) else a == b, (name, f.name)
        cols = want.position_ids[0]  # this rank's CP columns (the rows are unpacked: position = column)
        assert torch.equal(got.routing.known, routing.known[rows][:, cols]), name
        assert torch.equal(got.routing.real, routing.real[rows][:, cols]), name
        assert torch.equal(got.routing.experts, routing.experts[rows][:, cols][:, :, layers]), name
        assert got.metrics == {"rollout/reward_mean": 7.5}
        whole_routing = _size([routing.experts, routing.known, routing.real])
        whole = _size(getattr(full, f.name) for f in dataclasses.fields(full)) + whole_routing
        out[name] = got.bytes_received / whole
        out[name + "/routing"] = _size([got.routing.experts, got.routing.known, got.routing.real]) / whole_routing
        out[name + "/experts"] = _size([got.routing.experts]) / _size([routing.experts])
        dist.barrier()
    # rank 0's packing fails: both ranks raise its error, neither waits in a collective
    try:
        layout = BatchLayout(rows=16, num_minibatches=1, dp=2, micro_batch_size=8)
        scatter_batch(_failing_prepare, layout, init_parallel(ParallelConfig()))
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_each_rank_receives_its_part_and_no_more():
    for rank, out in enumerate(run_ranks(_scatter_every_layout, world_size=2, timeout=180)):
        assert out.pop("error") == "no kept ids", rank
        # DP=2 (EP=2 is DP=2 of the dense layout): half the rows. TP peers: the same whole rows.
        # PP=2: the whole rows, the routing of the stage's MoE layer only (one of two)
        # CP=2: every row, half its per-token columns, its routing included (per-row fields whole)
        assert out["dp2"] == out["ep2"] == 0.5 and out["tp2"] == 1.0, (rank, out)
        assert 0.5 < out["pp2"] < 1.0 and 0.5 < out["cp2"] < 1.0, (rank, out)
        assert out["tp2/routing"] == 1.0 and all(out[k + "/routing"] == 0.5 for k in ("dp2", "ep2", "cp2")), out
        assert out["pp2/experts"] == 0.5 and 0.5 < out["pp2/routing"] < 1.0, out  # known / real: whole rows
