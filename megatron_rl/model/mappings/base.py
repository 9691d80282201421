"""Weight-mapping vocabulary: how one mcore parameter relates to Hugging Face tensors.

A mapping is data: a tuple of `Param` entries per architecture (see common.py and the family files). The same data
drives checkpoint conversion, the embedded engine's weight sync and the vLLM weight export.
The shard math below is pure and rank-agnostic (rank and size are arguments).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class Kind(Enum):
    REPLICATED = "replicated"  # same on every TP rank (norms, router)
    COLUMN = "column"  # split on dim 0 over TP (embedding, output layer: vocab-parallel)
    ROW = "row"  # split on dim 1 over TP (attention out-proj, MLP down-proj)
    QKV = "qkv"  # HF (q, k, v) -> mcore fused, interleaved per query group, then COLUMN
    GATED = "gated"  # HF (gate, up) -> mcore fc1 = [gate_shard; up_shard] per TP rank


class Scope(Enum):
    GLOBAL = "global"  # once per model (embedding, final norm, output layer)
    LAYER = "layer"  # every layer (attention, norms)
    DENSE = "dense"  # layers with a dense MLP
    MOE = "moe"  # layers with a MoE MLP (router)
    EXPERT = "expert"  # every expert of a MoE layer; TP is expert-TP, experts split over EP


@dataclass(frozen=True)
class Param:
    """mcore parameter name template <-> HF tensor name template(s).

    Templates use {layer} (global 0-based layer index; mcore names use the stage-local index)
    and {expert} (HF: global expert id; mcore: local expert id on this EP rank).
    te_mcore: the name under Transformer Engine's layer spec where it differs (fused norms, grouped
        experts of TEGroupedMLP).
    stage: "first" | "last" | None; for GLOBAL params that live on one pipeline stage.
    export: False for an alias that must not be written back (tied output layer copy).
    fp32: exported in fp32 whatever the requested dtype (a buffer HF keeps in fp32: DeepSeek-V3's
        router score-correction bias, whose bf16 rounding would move routing decisions).
    """

    mcore: str
    hf: tuple[str, ...]
    kind: Kind
    scope: Scope
    te_mcore: str | None = None
    stage: str | None = None
    export: bool = True
    fp32: bool = False


def qkv_to_mcore(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int,
                 head_dim: int) -> torch.Tensor:
    """Fuse HF q [nh*d, *r], k [ng*d, *r], v [ng*d, *r] into mcore's [ng*(nh/ng + 2)*d, *r].

    r is (H,) for the weights and () for the biases (Qwen2). mcore interleaves per query group
    g: the nh/ng query heads of g, then k_g, then v_g, so that a contiguous chunk of rows is a
    whole number of groups (how TP shards it).
    """
    rest = q.shape[1:]
    per = num_heads // num_groups
    qg = q.reshape(num_groups, per * head_dim, *rest)
    kg = k.reshape(num_groups, head_dim, *rest)
    vg = v.reshape(num_groups, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def qkv_from_mcore(fused: torch.Tensor, num_heads: int, num_groups: int, head_dim: int):
    """Inverse of qkv_to_mcore: [ng*(nh/ng+2)*d, *r] -> (q, k, v)."""
    rest = fused.shape[1:]
    per = num_heads // num_groups
    g = fused.reshape(num_groups, (per + 2) * head_dim, *rest)
    q, k, v = torch.split(g, [per * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(),
            v.reshape(-1, *rest).contiguous())


def to_local_shard(kind: Kind, hf: list[torch.Tensor], rank: int, size: int, *, num_heads: int = 0,
                   num_groups: int = 0, head_dim: int = 0) -> torch.Tensor:
    """The mcore tensor that TP rank `rank` of `size` holds, from the full HF tensor(s)."""
    if kind is Kind.REPLICATED:
        return hf[0]
    if kind is Kind.COLUMN:
        return hf[0].chunk(size, dim=0)[rank]
    if kind is Kind.ROW:
        return hf[0].chunk(size, dim=1)[rank]
    if kind is Kind.QKV:
        return qkv_to_mcore(*hf, num_heads, num_groups, head_dim).chunk(size, dim=0)[rank]
    if kind is Kind.GATED:
        gate, up = hf
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    raise ValueError(kind)


def from_shards(kind: Kind, shards: list[torch.Tensor], *, num_heads: int = 0, num_groups: int = 0,
                head_dim: int = 0) -> list[torch.Tensor]:
    """Full HF tensor(s) from the mcore shards of all TP ranks (in rank order)."""
    if kind is Kind.REPLICATED:
        return [shards[0]]
    if kind is Kind.COLUMN:
        return [torch.cat(shards, dim=0)]
    if kind is Kind.ROW:
        return [torch.cat(shards, dim=1)]
    if kind is Kind.QKV:
        return list(qkv_from_mcore(torch.cat(shards, dim=0), num_heads, num_groups, head_dim))
    if kind is Kind.GATED:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(kind)
