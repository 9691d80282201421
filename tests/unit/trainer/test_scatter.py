"""The pure parts of the rank-0 scatter (trainer/scatter.py): which rows, columns and MoE layers each
rank of a DP x CP x TP x PP (x EP) layout gets, against the batch cut by hand, and the flat byte buffer."""
import pytest
import torch

from megatron_rl.moe import RolloutRouting
from megatron_rl.parallel.layout import BatchLayout
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.batch import build_batch, padded_length, row_multiple
from megatron_rl.trainer.scatter import from_buffer, part_tensors, row_plan, spec_of, stage_spec, to_buffer


def _samples(n: int, layers: int = 2, topk: int = 2) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p, r = 2 + i % 3, 1 + (i * 5) % 7
        out.append(Sample(prompt_ids=torch.randint(1, 50, (p,), generator=g),
                          response_ids=torch.randint(1, 50, (r,), generator=g),
                          rollout_logprobs=-torch.rand(r, generator=g), finish_reason="stop", policy_version=i % 2,
                          routed_experts=torch.randint(0, 4, (p + r - 1, layers, topk), generator=g).to(torch.int16),
                          kept_ids=torch.randint(0, 50, (r, 3), generator=g)))
    return out


def _coords(tp: int, pp: int, cp: int, dp: int) -> list[tuple[int, int, int]]:
    """(DP rank, CP rank, PP rank) of every global rank as megatron-core lays them out (its
    RankGenerator, default order): the independent reference for who shares which rows. EP needs
    no case of its own: experts split the dense layout's DP ranks (megatron's expert generator),
    whose rows these are."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    coords = [None] * (tp * pp * cp * dp)
    for dp_ranks in gen.get_ranks("dp"):
        for i, g in enumerate(dp_ranks):
            coords[g] = [i, None, None]
    for cp_ranks in gen.get_ranks("cp"):
        for i, g in enumerate(cp_ranks):
            coords[g][1] = i
    for pp_ranks in gen.get_ranks("pp"):
        for i, g in enumerate(pp_ranks):
            coords[g][2] = i
    return [tuple(c) for c in coords]


def _by_hand(t: torch.Tensor, rows: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """Rows `rows` of t and, under CP, chunks r and 2·CP-1-r of 2·CP along dim 1."""
    t = t[rows]
    if cp == 1:
        return t
    chunks = t.chunk(2 * cp, dim=1)
    return torch.cat([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]], dim=1)


@pytest.mark.parametrize("tp,pp,cp,dp", [(1, 1, 1, 2), (1, 1, 1, 4), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2),
                                         (2, 2, 2, 1), (2, 1, 2, 2)],
                         ids=["dp2", "dp4", "tp2dp2", "pp2dp2", "cp2dp2", "tp2pp2cp2", "tp2cp2dp2"])
def test_each_rank_gets_its_dp_rows_and_cp_columns(tp, pp, cp, dp):
    samples = _samples(16)
    full = build_batch(samples, [float(i) for i in range(16)], 0, padded_length(samples, row_multiple(tp, cp)),
                       with_kept_ids=True)
    routing = RolloutRouting.from_samples(samples, full.input_len + 1)
    layout = BatchLayout(rows=16, num_minibatches=2, dp=dp, micro_batch_size=2)
    coords = _coords(tp, pp, cp, dp)
    layers = [[0, 1] if pp == 1 else [stage] for _, _, stage in coords]  # 2 MoE layers, one a stage at PP 2
    plan = row_plan(layout, [c[:2] for c in coords], layers)
    seen = torch.zeros(16, full.input_len, dtype=torch.long)  # how often each (row, column) is trained
    routed = torch.zeros(16, full.input_len, 2, dtype=torch.long)  # ... and its routing of each layer received
    for g, share in enumerate(plan):
        dp_rank, cp_rank, _ = coords[g]
        rows = layout.local_rows(dp_rank)
        assert torch.equal(share.rows, rows) and share.cp_rank == cp_rank and share.layers == tuple(layers[g])
        got = part_tensors(full, routing, share, cp)
        for name in ("input_ids", "labels", "loss_mask", "rollout_logprobs", "advantages", "kept_ids", "position_ids"):
            assert torch.equal(got[name], _by_hand(getattr(full, name), rows, cp_rank, cp)), name
        assert torch.equal(got["rewards"], full.rewards[rows]) and torch.equal(got["versions"], full.versions[rows])
        for name in ("known", "real"):  # the routing: rows and CP columns like the per-token fields
            assert torch.equal(got[f"routing.{name}"], _by_hand(getattr(routing, name), rows, cp_rank, cp)), name
        # ... and of the experts only this stage's MoE layers
        assert torch.equal(got["routing.experts"], _by_hand(routing.experts, rows, cp_rank, cp)[:, :, layers[g]])
        routing_spec = [f for f in spec_of(got) if f[0].startswith("routing.")]
        assert stage_spec(spec_of(part_tensors(full, routing, plan[0], cp)), layers[g])[-3:] == routing_spec
        seen[rows[:, None], got["position_ids"]] += 1
        for layer in layers[g]:
            routed[rows[:, None], got["position_ids"], layer] += 1
    # every (row, column) is trained by exactly TP x PP ranks: each DP x CP cell once per model-parallel rank;
    # its routing of each MoE layer reaches only the TP ranks of the stage that holds the layer
    assert bool((seen == tp * pp).all())
    assert bool((routed == tp).all())


def test_the_buffer_round_trips_every_dtype_at_aligned_offsets():
    g = torch.Generator().manual_seed(1)
    tensors = {"b": torch.rand(3, 5, generator=g) > 0.5, "i16": torch.randint(-9, 9, (2, 3, 3), generator=g,
                                                                                dtype=torch.int16),
               "f": torch.rand(3, 7, generator=g), "l": torch.randint(0, 9, (1, 3), generator=g)}
    buf = to_buffer(tensors, torch.device("cpu"))
    assert buf.dtype == torch.uint8 and buf.numel() % 8 == 0
    back = from_buffer(buf, spec_of(tensors))
    assert list(back) == list(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k


def test_rows_that_do_not_split_over_cp_are_refused():
    samples = _samples(4)
    full = build_batch(samples, [0.0] * 4, 0, 12)  # 11 inputs: not a multiple of 2·CP = 4
    share = row_plan(BatchLayout(rows=4, num_minibatches=1, dp=1, micro_batch_size=4), [(0, 0)])[0]
    with pytest.raises(ValueError, match="multiple of 2\\*CP=4"):
        part_tensors(full, None, share, 2)
