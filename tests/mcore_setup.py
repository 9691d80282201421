"""Helpers for tests that build megatron-core models (in-process or inside spawned ranks)."""
from __future__ import annotations

import os
import tempfile

import torch

from megatron_rl.model.arch import ModelArch


def setup_parallel(seed: int = 1234, **sizes):
    """platform workarounds + megatron parallel groups for the given sizes (torch.distributed is up)."""
    from megatron_rl.parallel import ParallelConfig, init_parallel
    from megatron_rl.platform import apply_platform_workarounds

    apply_platform_workarounds()
    return init_parallel(ParallelConfig(**sizes), seed=seed)


def init_single_process():
    """torch.distributed with one gloo rank on a free port (for in-process tests)."""
    import torch.distributed as dist

    from tests.spawn import free_port

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", rank=0, world_size=1)


def random_hf_dir(arch: ModelArch, seed: int = 0, root: str | None = None) -> str:
    """Save a random `transformers` model of `arch` to a fresh directory; return its path.

    Under torch.distributed, transformers writes on rank 0 only: rank 0 saves and every rank
    gets rank 0's path.
    """
    import torch.distributed as dist

    from megatron_rl.model.parity import random_hf_model

    distributed = dist.is_initialized()
    path = [None]
    if not distributed or dist.get_rank() == 0:
        path[0] = tempfile.mkdtemp(prefix="hf-", dir=root)
        random_hf_model(arch, seed=seed).save_pretrained(path[0])
    if distributed:
        dist.broadcast_object_list(path, src=0)
    return path[0]


def hf_tensors(path: str) -> dict[str, torch.Tensor]:
    from megatron_rl.model.hf_io import SafetensorsReader

    reader = SafetensorsReader(path)
    return {k: reader(k) for k in reader.keys()}  # noqa: SIM118 - a reader, not a dict: keys() is its listing
