"""Routing agreement and replay-coverage values (megatron_rl.moe.metrics), hand-computed cases."""
import torch

from megatron_rl.metrics.reduce import accumulate, finish
from megatron_rl.moe.metrics import (
    layer_agreement_sums,
    routing_agreement_by_turn,
    routing_agreement_sums,
    same_expert_set,
    turn_counts,
)


def test_same_expert_set_ignores_order():
    a = torch.tensor([[0, 1], [2, 3], [1, 3]])
    b = torch.tensor([[1, 0], [2, 1], [3, 1]])
    assert same_expert_set(a, b).tolist() == [True, False, True]


def test_agreement_sums_by_global_layer():
    # this rank holds MoE layers 1 and 2 of 4; layer 1 agrees on 2 of 3 masked tokens, layer 2 on 1 of 3
    a = [torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2]]), torch.tensor([[0, 1], [0, 1], [0, 1], [0, 1]])]
    b = [torch.tensor([[1, 0], [2, 1], [3, 1], [3, 3]]), torch.tensor([[1, 0], [2, 3], [2, 3], [1, 0]])]
    mask = torch.tensor([True, True, True, False])
    s = routing_agreement_sums(a, b, mask, layer_ids=(1, 2), num_moe_layers=4, name="route_agree_old_new")
    assert float(s["moe/route_agree_old_new/layer_1/num/sum"]) == 2
    assert float(s["moe/route_agree_old_new/layer_2/num/sum"]) == 1
    assert float(s["moe/route_agree_old_new/layer_0/den/sum"]) == 0  # another stage's layer
    assert float(s["moe/route_agree_old_new/den/sum"]) == 6
    # the other stage holds layers 0 and 3, all tokens agree: sums add up like an all-reduce over PP
    other = routing_agreement_sums([a[0], a[0]], [a[0], a[0]], None, (0, 3), 4, "route_agree_old_new")
    out = finish(accumulate(s, other))
    assert out["moe/route_agree_old_new"] == (3 + 8) / (6 + 8)
    assert out["moe/route_agree_old_new/layer_1"] == 2 / 3
    assert out["moe/route_agree_old_new/layer_3"] == 1.0


def test_layer_agreement_sums_keys_are_the_same_on_every_stage():
    k1 = layer_agreement_sums(torch.tensor([1.0]), torch.tensor([2.0]), (0,), 2, "x").keys()
    k2 = layer_agreement_sums(torch.tensor([1.0]), torch.tensor([2.0]), (1,), 2, "x").keys()
    assert k1 == k2


def test_replayed_fraction_and_empty_denominators():
    s = {"moe/replayed_token_fraction/num/sum": torch.tensor(3.0, dtype=torch.float64),
         "moe/replayed_token_fraction/den/sum": torch.tensor(4.0, dtype=torch.float64),
         "moe/x/num/sum": torch.tensor(0.0), "moe/x/den/sum": torch.tensor(0.0)}
    assert finish(s) == {"moe/replayed_token_fraction": 0.75, "moe/x": 0.0}


def _by_turn_reference(a, b, mask, turns):
    """Per bucket label: (agreeing, counted) (token, layer) pairs, by a plain loop over tokens."""
    out = {}
    for x, y in zip(a, b):
        for t in range(len(turns)):
            if turns[t] < 0 or (mask is not None and not mask[t]):
                continue
            label = str(int(turns[t])) if turns[t] < 3 else "3_or_later"
            n, d = out.get(label, (0, 0))
            out[label] = (n + int(sorted(x[t].tolist()) == sorted(y[t].tolist())), d + 1)
    return out


def test_agreement_by_turn_against_a_loop():
    g = torch.Generator().manual_seed(3)
    a = [torch.randint(0, 4, (40, 2), generator=g) for _ in range(2)]
    b = [torch.randint(0, 4, (40, 2), generator=g) for _ in range(2)]
    turns = torch.randint(-1, 6, (40,), generator=g)
    mask = torch.rand(40, generator=g) > 0.3
    for m in (mask, None):
        s = routing_agreement_by_turn(a, b, m, turns, "route_agree_rollout_train")
        want = _by_turn_reference(a, b, m, turns)
        for label in ("0", "1", "2", "3_or_later"):  # every bucket's keys, counted or not
            n, d = want.get(label, (0, 0))
            assert float(s[f"moe/route_agree_rollout_train/turn/{label}/num/sum"]) == n
            assert float(s[f"moe/route_agree_rollout_train/turn/{label}/den/sum"]) == d
        assert sum(d for _, d in want.values()) > 0 and any(n for n, _ in want.values())


def test_turn_counts_leave_out_tokens_without_a_turn():
    same = torch.tensor([True, False, True, True, True])
    agree, total = turn_counts(same, torch.tensor([True, True, True, True, False]), torch.tensor([-1, 0, 0, 7, 1]))
    assert agree.tolist() == [1, 0, 0, 1] and total.tolist() == [2, 0, 0, 1]
    empty = routing_agreement_by_turn([], [], None, torch.zeros(0, dtype=torch.long), "x")
    assert sorted(empty) == sorted(f"moe/x/turn/{t}/{p}/sum" for t in ("0", "1", "2", "3_or_later")
                                   for p in ("num", "den"))
