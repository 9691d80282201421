"""Engine routing -> per-rank replay indices (megatron_rl.moe.plumbing), hand-built cases."""
import pytest
import torch

from megatron_rl.logprobs.context_parallel import zigzag_indices
from megatron_rl.moe.plumbing import (
    RolloutRouting,
    TokenLayout,
    live_routing_needed,
    local_mask,
    replay_routing,
    replayed_token_sums,
    spread_experts,
)
from megatron_rl.moe.replay import MicroBatchRouting
from megatron_rl.rollout.types import Sample


def _pos_rows(b, s):
    """x[row, pos] = 100 * row + pos."""
    return 100 * torch.arange(b)[:, None] + torch.arange(s)[None, :]


def test_sequence_first_flattening():
    # megatron's router sees [s, b] flattened: token s*b + row
    assert TokenLayout().to_local(_pos_rows(2, 4)).tolist() == [0, 100, 1, 101, 2, 102, 3, 103]


def test_trailing_dims_follow_the_tokens():
    x = torch.stack([_pos_rows(2, 3), -_pos_rows(2, 3)], dim=-1)  # [b, S, 2]
    assert TokenLayout().to_local(x).tolist() == [[0, 0], [100, -100], [1, -1], [101, -101], [2, -2], [102, -102]]


def test_sequence_parallel_scatter():
    x = _pos_rows(2, 4)
    rank0 = TokenLayout(tp_size=2, tp_rank=0, sequence_parallel=True).to_local(x)
    rank1 = TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True).to_local(x)
    assert rank0.tolist() == [0, 100, 1, 101]  # contiguous first half of the sequence, all rows
    assert rank1.tolist() == [2, 102, 3, 103]
    # without sequence parallelism every TP rank routes every token
    assert TokenLayout(tp_size=2, tp_rank=1).to_local(x).tolist() == TokenLayout().to_local(x).tolist()
    with pytest.raises(ValueError, match="sequence parallel"):
        TokenLayout(tp_size=2, tp_rank=0, sequence_parallel=True).to_local(_pos_rows(1, 3))


def _coded(b, s, layers=3):
    """Routing whose experts hold their own coordinates: experts[row, pos, layer] = 100·row + pos + 1000·layer."""
    x = _pos_rows(b, s)
    experts = (x[:, :, None] + 1000 * torch.arange(layers)[None, None, :])[..., None]
    return RolloutRouting(experts, torch.ones(b, s, dtype=torch.bool), x % 2 == 0)


def test_rank_part_cuts_rows_zigzag_columns_and_layers_then_sequence_parallel():
    # CP=2: 8 positions -> 4 chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    rr = _coded(3, 8)
    part = rr.rank_part(torch.tensor([2, 0]), cp_rank=0, cp=2, layer_ids=[2])
    assert part.experts[..., 0].tolist() == [[[2200], [2201], [2206], [2207]], [[2000], [2001], [2006], [2007]]]
    assert torch.equal(part.real, rr.real[[2, 0]][:, zigzag_indices(0, 2, total_len=8)])
    assert rr.rank_part(slice(None), cp_rank=1, cp=2).experts[0, :, :, 0].tolist() == \
        [[p + 1000 * layer for layer in range(3)] for p in (2, 3, 4, 5)]
    # then SP splits the CP-local sequence contiguously over TP
    lay = TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True)
    assert lay.to_local(rr.rank_part(slice(0, 2), 0, 2, [0]).experts)[:, 0, 0].tolist() == [6, 106, 7, 107]
    # every (CP, TP) rank together covers every position once
    covered = sorted(p for c in range(2) for t in range(2)
                     for p in TokenLayout(2, t, True).to_local(rr.rank_part(slice(0, 1), c, 2, [0]).experts)[:, 0, 0]
                     .tolist())
    assert covered == list(range(8))


def _sample(p, r, routed):
    return Sample(prompt_ids=torch.arange(1, p + 1), response_ids=torch.arange(1, r + 1),
                  rollout_logprobs=torch.zeros(r), finish_reason="stop", policy_version=0, routed_experts=routed)


def _routes(n, layers=2, k=2, base=0):
    """[n, L, k] with experts {(base + t + l) % 4, (base + t + l + 1) % 4}: distinct per token."""
    t = torch.arange(n)[:, None, None] + torch.arange(layers)[None, :, None] + torch.arange(k)[None, None, :]
    return ((base + t) % 4).to(torch.int16)


def test_rollout_routing_from_samples():
    samples = [_sample(2, 3, _routes(4)),  # full: P + R - 1 = 4 positions
               _sample(2, 2, None),  # no routing
               _sample(3, 2, _routes(2, base=1))]  # generated tokens only: last 2 of 4 positions
    rr = RolloutRouting.from_samples(samples, seq_len=6)  # 5 input positions per row
    assert rr.real.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]]
    assert rr.known.tolist() == [[1, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 0]]
    assert torch.equal(rr.experts[0, :4], _routes(4))
    assert torch.equal(rr.experts[2, 2:4], _routes(2, base=1))
    assert live_routing_needed(rr) and not live_routing_needed(rr.select(slice(0, 1)))
    s = replayed_token_sums(rr)
    assert float(s["moe/replayed_token_fraction/num/sum"]) == 6
    assert float(s["moe/replayed_token_fraction/den/sum"]) == 11
    with pytest.raises(ValueError, match="more than"):
        RolloutRouting.from_samples([_sample(2, 3, _routes(5))], seq_len=6)
    with pytest.raises(ValueError, match="does not match"):
        RolloutRouting.from_samples([_sample(2, 3, _routes(4)), _sample(2, 3, _routes(4, layers=3))], seq_len=6)
    assert RolloutRouting.from_samples([_sample(2, 2, None)], seq_len=4).experts is None


def test_replay_routing_padding_gets_spread_experts():
    rr = RolloutRouting.from_samples([_sample(2, 3, _routes(4)), _sample(2, 1, _routes(2, base=2))], seq_len=6)
    mb = replay_routing(rr.rank_part(slice(None), layer_ids=[1]), TokenLayout(), layer_ids=[1], num_experts=4)
    idx = mb.indices[0].view(5, 2, 2)  # [s, b, k]
    assert torch.equal(idx[:4, 0], _routes(4)[:, 1].long())  # row 0, MoE layer 1
    assert torch.equal(idx[:2, 1], _routes(2, base=2)[:, 1].long())
    spread = spread_experts(10, 2, 4).view(5, 2, 2)
    assert torch.equal(idx[4, 0], spread[4, 0]) and torch.equal(idx[2:, 1], spread[2:, 1])
    assert all(len(set(t.tolist())) == 2 for t in mb.indices[0])  # k distinct experts everywhere
    assert mb.mask.view(5, 2).tolist() == [[1, 1], [1, 1], [1, 0], [1, 0], [0, 0]]


def test_replay_routing_hybrid_fill_from_live_record():
    rr = RolloutRouting.from_samples([_sample(3, 2, _routes(2, base=1)), _sample(2, 2, None)], seq_len=6)
    with pytest.raises(ValueError, match="RECORD pass"):
        replay_routing(rr, TokenLayout(), [0, 1], num_experts=4)
    live = MicroBatchRouting([torch.full((10, 2), 7), torch.full((10, 2), 8)])  # stand-in live choices
    mb = replay_routing(rr, TokenLayout(), [0, 1], num_experts=4, live=live)
    for layer, fill in ((0, 7), (1, 8)):
        idx = mb.indices[layer].view(5, 2, 2)
        assert torch.equal(idx[2:4, 0], _routes(2, base=1)[:, layer].long())  # engine-routed positions
        assert (idx[:2, 0] == fill).all() and (idx[4:, 0] == fill).all() and (idx[:, 1] == fill).all()
    assert mb.mask.view(5, 2).tolist() == [[0, 0], [0, 0], [1, 0], [1, 0], [0, 0]]
    # a micro-batch without any engine routing replays the live record as is
    none = replay_routing(rr.select(slice(1, 2)), TokenLayout(), [0, 1], 4,
                          live=MicroBatchRouting([torch.zeros(5, 2), torch.ones(5, 2)]))
    assert none.indices[1].dtype == torch.long and (none.indices[1] == 1).all()
    with pytest.raises(ValueError, match="expected"):
        replay_routing(rr, TokenLayout(), [0, 1], 4, live=MicroBatchRouting([torch.zeros(9, 2)] * 2))


def test_replay_routing_under_sequence_parallel_and_pp():
    rr = RolloutRouting.from_samples([_sample(3, 2, _routes(4, layers=3))], seq_len=5)  # 4 positions, 1 row
    full = replay_routing(rr, TokenLayout(), [0, 1, 2], 4)
    sp = TokenLayout(tp_size=2, tp_rank=1, sequence_parallel=True)
    tp1 = replay_routing(rr.rank_part(slice(None), layer_ids=[2]), sp, [2], 4)  # the stage's part only
    assert torch.equal(tp1.indices[0], full.indices[2][2:])  # second half of the sequence, MoE layer 2
    assert local_mask(rr.real, sp).tolist() == [True, True]
    with pytest.raises(ValueError, match="rank_part"):  # routing of every layer is not this stage's part
        replay_routing(rr, sp, [2], 4)


def test_replay_of_each_cp_rank_part_is_the_single_rank_replay_at_its_positions():
    """CP=2 x TP=2 (SP): what each rank replays from its part (RolloutRouting.rank_part, as rank 0
    sends it) is the one-rank replay of the whole rows at the positions that rank routes."""
    rr = RolloutRouting.from_samples([_sample(3, 4, _routes(6, layers=3)), _sample(2, 2, _routes(3, layers=3, base=1))],
                                     seq_len=9)  # 8 positions, the second row mostly padding
    one = replay_routing(rr, TokenLayout(), [0, 1, 2], 4)
    whole = torch.stack(one.indices, 1).view(8, 2, 3, 2)  # [s, b, layer, k]
    known = rr.known.T  # [s, b]
    for c in range(2):
        cols = zigzag_indices(c, 2, total_len=8)
        for t in range(2):
            lay = TokenLayout(tp_size=2, tp_rank=t, sequence_parallel=True)
            got = replay_routing(rr.rank_part(slice(None), c, 2, [1, 2]), lay, [1, 2], 4)
            pos = cols[t * 2:(t + 1) * 2]
            for j, layer in enumerate((1, 2)):
                idx = got.indices[j].view(2, 2, 2)
                where = known[pos][..., None]  # padding takes any valid experts: compare engine-routed ones
                assert torch.equal(torch.where(where, idx, -1), torch.where(where, whole[pos, :, layer], -1))
            assert torch.equal(got.mask.view(2, 2), (rr.known & rr.real).T[pos])


def test_replay_routing_rejects_bad_expert_ids():
    rr = RolloutRouting.from_samples([_sample(2, 2, torch.full((3, 1, 2), 9, dtype=torch.int16))], seq_len=4)
    with pytest.raises(ValueError, match="outside"):
        replay_routing(rr, TokenLayout(), [0], num_experts=4)
