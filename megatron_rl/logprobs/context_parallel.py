"""Context-parallel token layout: zig-zag sharding of (packed) sequences, positions, label shift.

Zig-zag load balancing (as megatron-core `get_batch_on_this_cp_rank` and Transformer Engine's
`thd_get_partitioned_indices` do): every sequence of length L (a multiple of 2·CP) is cut into
2·CP chunks of L/(2·CP) tokens; CP rank r holds chunks r and 2·CP−1−r, in that order, so every
rank gets the same share of causal-attention work. Packed variable-length batches (THD layout,
`cu_seqlens = [0, L_0, L_0+L_1, …]`, each `L_i` already padded to a multiple of 2·CP) are sharded
sequence by sequence and concatenated: the local cumulative lengths are `cu_seqlens // CP`.

Labels must be shifted **before** sharding (`next_token_labels`): the next token of a chunk's
last position lives on another rank. Per-token outputs computed on the local shard stay in the
local layout; per-sequence reductions are finished elsewhere with a CP all-reduce of partial sums.

Index tensors are built on the host from `cu_seqlens` (a host sync when it lives on a GPU; do it
once per batch, in the data pipeline).
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import torch.distributed as dist


def _cu_list(cu_seqlens: torch.Tensor | Sequence[int] | None, total: int | None) -> list[int]:
    if cu_seqlens is None:
        if total is None:
            raise ValueError("need cu_seqlens or the sequence length")
        return [0, int(total)]
    cu = [int(v) for v in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if cu[0] != 0 or any(b < a for a, b in pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    if total is not None and cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {cu[-1]} but the tensor has {total} tokens")
    return cu


def zigzag_indices(
    cp_rank: int,
    cp_size: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    *,
    total_len: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Global token index of every local token of `cp_rank`: `[T/CP]` int64, local layout order.

    `cu_seqlens` `[n_seq + 1]` (packed) or None (one sequence of `total_len` tokens).
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} not in [0, {cp_size})")
    cu = _cu_list(cu_seqlens, total_len)
    parts = []
    for start, end in pairwise(cu):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(f"sequence length {length} is not a multiple of 2*CP={2 * cp_size}; "
                             "pad every sequence to a multiple of 2*CP before sharding")
        c = length // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
    idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return idx.to(device) if device is not None else idx


def local_cu_seqlens(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Cumulative lengths of the local shard: `cu_seqlens // cp_size` (each L_i divisible by 2·CP)."""
    return torch.div(cu_seqlens, cp_size, rounding_mode="floor")


def zigzag_shard(
    x: torch.Tensor,
    cp_rank: int,
    cp_size: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """This CP rank's zig-zag shard of `x` along `seq_dim`: `[.., T, ..] -> [.., T/CP, ..]`.

    Without `cu_seqlens` the whole `seq_dim` is one sequence per row (e.g. `[B, S]` with
    `seq_dim=1`); with it, `seq_dim` holds packed sequences (THD). Differentiable (index_select).
    """
    idx = zigzag_indices(cp_rank, cp_size, cu_seqlens, total_len=x.shape[seq_dim], device=x.device)
    return x.index_select(seq_dim, idx)


def zigzag_unshard(
    shards: Sequence[torch.Tensor],
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """Inverse of `zigzag_shard`: the CP ranks' shards (in rank order) -> the full tensor."""
    cp_size = len(shards)
    total = sum(s.shape[seq_dim] for s in shards)
    out = shards[0].new_empty(shards[0].shape[:seq_dim] + (total,) + shards[0].shape[seq_dim + 1:])
    for r, s in enumerate(shards):
        idx = zigzag_indices(r, cp_size, cu_seqlens, total_len=total, device=s.device)
        out = out.index_copy(seq_dim, idx, s)
    return out


def zigzag_all_gather(
    x_local: torch.Tensor,
    cp_group: dist.ProcessGroup,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """All-gather the local shards over `cp_group` and undo the zig-zag (for tests/diagnostics;
    not differentiable). `cu_seqlens` is the global (padded) one."""
    shards = [torch.empty_like(x_local) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(shards, x_local.contiguous(), group=cp_group)
    return zigzag_unshard(shards, cu_seqlens, seq_dim=seq_dim)


def global_positions(
    cp_rank: int,
    cp_size: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    *,
    total_len: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Position of every local token within its own sequence: `[T/CP]` int64 (0 = first token)."""
    cu = _cu_list(cu_seqlens, total_len)
    idx = zigzag_indices(cp_rank, cp_size, cu)
    lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    starts = torch.repeat_interleave(torch.tensor(cu[:-1]), lengths // cp_size)
    pos = idx - starts
    return pos.to(device) if device is not None else pos


def next_token_labels(
    input_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """`labels[t] = input_ids[t+1]` within each sequence, `ignore_index` at each sequence's last
    position. `input_ids`: `[T]` packed (with `cu_seqlens`) or `[..., S]` (no `cu_seqlens`).
    Call it on the full sequence, before `zigzag_shard`."""
    labels = torch.full_like(input_ids, ignore_index)
    if cu_seqlens is None:
        labels[..., :-1] = input_ids[..., 1:]
        return labels
    if input_ids.dim() != 1:
        raise ValueError("packed input_ids must be 1-D [T]")
    cu = _cu_list(cu_seqlens, input_ids.shape[0])
    labels[:-1] = input_ids[1:]
    ends = torch.tensor([e - 1 for s, e in pairwise(cu) if e > s], dtype=torch.long)
    labels[ends.to(labels.device)] = ignore_index
    return labels
