"""MoE routing agreement as ratios in the metrics convention (megatron_rl/metrics/reduce.py).

    moe/<name>              fraction of (token, layer) whose top-k expert SET is equal in a and b
    moe/<name>/layer_<l>    the same for MoE layer l (index among all MoE layers of the model)

    moe/<name>/turn/<t>     the same over the (token, layer) pairs of policy turn t (t in 0, 1, 2,
                            3_or_later; multi-turn batches only, TrainBatch.turns): a token counts
                            in the turn of the label its position predicts

with name `route_agree_rollout_train` (engine vs trainer) or `route_agree_old_new` (θ_old vs θ).

Every rank produces values for *every* MoE layer of the model (zeros for layers of other pipeline
stages), so all ranks hold the same keys and one SUM reduction over the whole world combines
TP/SP shards, CP shards, pipeline stages and DP ranks. Ranks that hold the same tokens (TP
without sequence parallelism) add the same amount to numerator and denominator, which cancels.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_rl.metrics.mismatch import TURN_BUCKETS, turn_labels
from megatron_rl.metrics.reduce import ratio

_F64 = torch.float64


def same_expert_set(a: Tensor, b: Tensor) -> Tensor:
    """`[T, k]` x `[T, k]` expert ids -> `[T]` bool, equal as sets (order within k ignored)."""
    return (a.sort(dim=-1).values == b.to(a.device).sort(dim=-1).values).all(dim=-1)


def layer_agreement_sums(agree: Tensor, total: Tensor, layer_ids: Sequence[int], num_moe_layers: int,
                         name: str) -> dict[str, Tensor]:
    """Per-local-layer counts -> ratios keyed by global MoE layer (zeros for the other layers).

    agree, total: `[len(layer_ids)]` counts on this rank (any device); layer_ids: their MoE layer indices.
    """
    a = torch.zeros(num_moe_layers, dtype=_F64, device=agree.device)
    t = torch.zeros(num_moe_layers, dtype=_F64, device=agree.device)
    if len(layer_ids):
        ids = torch.tensor(list(layer_ids), dtype=torch.long, device=agree.device)
        a[ids] = agree.detach().double()
        t[ids] = total.detach().double().to(agree.device)
    out = ratio(f"moe/{name}", a.sum(), t.sum())
    for layer in range(num_moe_layers):
        out.update(ratio(f"moe/{name}/layer_{layer}", a[layer], t[layer]))
    return out


def routing_agreement_sums(a: Sequence[Tensor], b: Sequence[Tensor], mask: Tensor | None,
                           layer_ids: Sequence[int], num_moe_layers: int, name: str) -> dict[str, Tensor]:
    """Agreement of two routings of the same local tokens (e.g. a RECORD pass vs the engine's).

    a, b: per local layer `[T, k]` expert ids (MicroBatchRouting.indices); mask: `[T]` bool tokens
    to count (None = all); layer_ids / num_moe_layers as in `layer_agreement_sums`.
    """
    if len(a) != len(b) or len(a) != len(layer_ids):
        raise ValueError(f"{len(a)} and {len(b)} layers for {len(layer_ids)} layer ids")
    device = a[0].device if len(a) else torch.device("cpu")
    agree, total = torch.zeros(len(a), dtype=_F64, device=device), torch.zeros(len(a), dtype=_F64, device=device)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        same = same_expert_set(x, y)
        m = torch.ones_like(same) if mask is None else mask.to(same.device).bool()
        agree[i] = (same & m).sum(dtype=_F64)
        total[i] = m.sum(dtype=_F64)
    return layer_agreement_sums(agree, total, layer_ids, num_moe_layers, name)


def turn_counts(same: Tensor, mask: Tensor | None, turns: Tensor) -> tuple[Tensor, Tensor]:
    """Agreeing and counted tokens per policy-turn bucket.

    same: `[T]` bool, a token's two routings agree; mask: `[T]` bool tokens to count (None = all);
    turns: `[T]` int policy turn of each token (-1: none, never counted). Returns (agree, total),
    `[TURN_BUCKETS]` float64 on same's device: turns 0, 1, 2 each, then 3 and later together.
    Cost O(T · TURN_BUCKETS), no host sync.
    """
    turns = turns.to(same.device)
    bucket = torch.where(turns < 0, -1, turns.clamp(max=TURN_BUCKETS - 1))
    keep = bucket >= 0 if mask is None else (bucket >= 0) & mask.to(same.device).bool()
    sel = (bucket[:, None] == torch.arange(TURN_BUCKETS, device=same.device)[None, :]) & keep[:, None]
    return (sel & same.bool()[:, None]).sum(0, dtype=_F64), sel.sum(0, dtype=_F64)


def turn_agreement_sums(agree: Tensor, total: Tensor, name: str) -> dict[str, Tensor]:
    """`[TURN_BUCKETS]` counts (summed over this rank's layers) -> ratios `moe/<name>/turn/<t>`,
    every bucket present on every rank (zeros where none), so a SUM over the world combines them."""
    out = {}
    for k, label in enumerate(turn_labels()):
        out.update(ratio(f"moe/{name}/turn/{label}", agree[k], total[k]))
    return out


def routing_agreement_by_turn(a: Sequence[Tensor], b: Sequence[Tensor], mask: Tensor | None, turns: Tensor,
                              name: str) -> dict[str, Tensor]:
    """`routing_agreement_sums`' (token, layer) agreement split by policy turn: a, b per local layer
    `[T, k]` expert ids, mask `[T]` bool (None = all), turns `[T]` int (-1 = no turn)."""
    device = a[0].device if len(a) else turns.device
    agree = torch.zeros(TURN_BUCKETS, dtype=_F64, device=device)
    total = torch.zeros(TURN_BUCKETS, dtype=_F64, device=device)
    for x, y in zip(a, b, strict=True):
        n, d = turn_counts(same_expert_set(x, y), mask, turns)
        agree, total = agree + n, total + d
    return turn_agreement_sums(agree, total, name)
