"""megatron-core calls whose signature or private state differs between the releases we support:
the one place outside the workarounds that reads a private megatron name or probes a signature.

    local = cp_zigzag_shard({"input_ids": ids, ...}, cp_group)   # this CP rank's zig-zag shard
    grad_accum_fusion_available()                                # the fused wgrad kernel's flag
"""
from __future__ import annotations

import inspect

import torch


def cp_zigzag_shard(tensors: dict[str, torch.Tensor], cp_group) -> dict[str, torch.Tensor]:
    """This CP rank's zig-zag shard of each [N, L] tensor -> [N, L / CP], by megatron-core's own
    `get_batch_on_this_cp_rank` (2·CP chunks per row; rank r keeps chunks r and 2·CP−1−r)."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        # megatron-core >= 0.18.0: a required `is_hybrid_cp` (hybrid CP of packed sequences, which
        # reads `cu_seqlens` from the batch). Without `cu_seqlens` it takes the same per-sequence
        # zig-zag split as 0.16/0.17 whatever the flag; False says we use no hybrid CP.
        return get_batch_on_this_cp_rank(tensors, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(tensors, cp_group=cp_group)


def grad_accum_fusion_available() -> bool:
    """Whether megatron-core found its fused weight-gradient accumulation kernel (a private module
    flag of megatron.core.tensor_parallel.layers; False where the flag does not exist)."""
    from megatron.core.tensor_parallel import layers

    return bool(getattr(layers, "_grad_accum_fusion_available", False))
