"""MoE routing agreement and replay coverage, as reducible sums (float64 0-dim tensors).

Keys (finished by `finish_routing_metrics`):

    moe/<name>              fraction of (token, layer) whose top-k expert SET is equal in a and b
    moe/<name>/layer_<l>    the same for MoE layer l (index among all MoE layers of the model)
    moe/replayed_token_fraction   real tokens replayed from the engine / real tokens (R3)

with name `route_agree_rollout_train` (engine vs trainer) or `route_agree_old_new` (θ_old vs θ).

Every rank produces sums for *every* MoE layer of the model (zeros for layers of other pipeline
stages), so all ranks hold the same keys and one SUM all-reduce over the whole world
(`reduce_routing_sums`) combines TP/SP shards, CP shards, pipeline stages and DP ranks. Ranks
that hold the same tokens (TP without sequence parallelism, the row-level coverage counts on
every TP/PP/CP rank) add the same amount to numerator and denominator, which cancels in the ratio.
(`megatron_rl.metrics.mismatch.routing_agreement_sums` takes `[B, T, L, k]` rows with local layer
numbers under the `mismatch/` namespace; here the inputs are a rank's local per-layer tensors, so
the sums are built directly and only its all-reduce helper is reused.)
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from megatron_rl.metrics.mismatch import all_reduce_sums

_F64 = torch.float64


def same_expert_set(a: Tensor, b: Tensor) -> Tensor:
    """`[T, k]` x `[T, k]` expert ids -> `[T]` bool, equal as sets (order within k ignored)."""
    return (a.sort(dim=-1).values == b.to(a.device).sort(dim=-1).values).all(dim=-1)


def layer_agreement_sums(agree: Tensor, total: Tensor, layer_ids: Sequence[int], num_moe_layers: int,
                         name: str) -> dict[str, Tensor]:
    """Per-local-layer counts -> sums keyed by global MoE layer (zeros for the other layers).

    agree, total: `[len(layer_ids)]` counts on this rank; layer_ids: their MoE layer indices.
    """
    a = torch.zeros(num_moe_layers, dtype=_F64)
    t = torch.zeros(num_moe_layers, dtype=_F64)
    ids = torch.tensor(list(layer_ids), dtype=torch.long)
    if len(ids):
        a[ids] = agree.detach().double().cpu()
        t[ids] = total.detach().double().cpu()
    out = {f"moe/{name}/agree/sum": a.sum(), f"moe/{name}/total/sum": t.sum()}
    for layer in range(num_moe_layers):
        out[f"moe/{name}/layer_{layer}/agree/sum"] = a[layer]
        out[f"moe/{name}/layer_{layer}/total/sum"] = t[layer]
    return out


def routing_agreement_sums(a: Sequence[Tensor], b: Sequence[Tensor], mask: Tensor | None,
                           layer_ids: Sequence[int], num_moe_layers: int, name: str) -> dict[str, Tensor]:
    """Agreement of two routings of the same local tokens (e.g. a RECORD pass vs the engine's).

    a, b: per local layer `[T, k]` expert ids (MicroBatchRouting.indices); mask: `[T]` bool tokens
    to count (None = all); layer_ids / num_moe_layers as in `layer_agreement_sums`.
    """
    if len(a) != len(b) or len(a) != len(layer_ids):
        raise ValueError(f"{len(a)} and {len(b)} layers for {len(layer_ids)} layer ids")
    agree, total = torch.zeros(len(a), dtype=_F64), torch.zeros(len(a), dtype=_F64)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        same = same_expert_set(x, y)
        m = torch.ones_like(same) if mask is None else mask.to(same.device).bool()
        agree[i] = (same & m).sum(dtype=_F64).cpu()
        total[i] = m.sum(dtype=_F64).cpu()
    return layer_agreement_sums(agree, total, layer_ids, num_moe_layers, name)


def add_sums(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Key-wise sum (keys of either)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


def reduce_routing_sums(sums: Mapping[str, Tensor], group=None) -> dict[str, Tensor]:
    """SUM all-reduce over `group` (default: every rank). Every rank must pass the same keys."""
    return all_reduce_sums({k: v.double() for k, v in sums.items()}, group)


def finish_routing_metrics(sums: Mapping[str, Tensor]) -> dict[str, float]:
    """Reduced sums -> `moe/<name>`, `moe/<name>/layer_<l>`, `moe/replayed_token_fraction`."""
    s = {k: float(v) for k, v in sums.items()}
    out: dict[str, float] = {}
    for key, v in s.items():
        if key.endswith("/agree/sum"):
            base = key[: -len("/agree/sum")]
            den = s[f"{base}/total/sum"]
            if den > 0:
                out[base] = v / den
    if s.get("moe/real_tokens/sum", 0.0) > 0:
        out["moe/replayed_token_fraction"] = s["moe/replayed_tokens/sum"] / s["moe/real_tokens/sum"]
    return out
