"""Initialise torch.distributed and megatron-core model parallelism; return the groups explicitly.

This is the one place that touches megatron-core's global `parallel_state`: megatron's model
classes still read it, but our code receives a `ParallelGroups` and never reaches for globals.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes (Megatron flag names in brackets). DP is what is left of the world.

    tensor_model_parallel_size: TP [--tensor-model-parallel-size]; MoE with TP>1 turns on
        sequence parallelism (megatron-core requires it).
    pipeline_model_parallel_size: PP [--pipeline-model-parallel-size].
    expert_model_parallel_size: EP [--expert-model-parallel-size]; experts are split over EP ranks.
    expert_tensor_parallel_size: expert-TP [--expert-tensor-parallel-size]; None means = TP.
        TP=2 x EP=2 on 2 ranks needs expert-TP 1.
    context_parallel_size: CP [--context-parallel-size]; every rollout row is split zig-zag
        over CP ranks (long responses). The model forward under CP needs Transformer Engine's
        CP attention (GPU); on CPU a CP run stops at start-up.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    context_parallel_size: int = 1

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size", "context_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size < 1:
            raise ValueError("parallel.expert_tensor_parallel_size must be >= 1 or null (= TP)")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """DP = world / (TP·PP·CP), after checking that `world_size` ranks fit both the dense layout
        (TP x PP x CP) and the expert layout (expert-TP x EP x PP); ValueError naming the fix."""
        model_ranks = self.tp * self.pp * self.cp
        if world_size % model_ranks:
            raise ValueError(f"world size {world_size} is not a multiple of tensor x pipeline x context parallel "
                             f"sizes = {self.tp} x {self.pp} x {self.cp}; launch a multiple of {model_ranks} ranks")
        expert_ranks = self.etp * self.ep * self.pp
        if world_size % expert_ranks:
            fix = ("set --expert-tensor-parallel-size 1 (expert-TP defaults to TP)"
                   if self.etp > 1 and world_size % (self.ep * self.pp) == 0 else
                   f"launch a multiple of {expert_ranks} ranks (torchrun --nproc_per_node) or lower "
                   f"--expert-model-parallel-size")
            raise ValueError(f"world size {world_size} is not a multiple of expert tensor x expert x pipeline "
                             f"parallel sizes = {self.etp} x {self.ep} x {self.pp}; {fix}")
        return world_size // model_ranks


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups and this rank's coordinates in them.

    `pgs` is megatron-core's ProcessGroupCollection (fields tp, pp, cp, ep, expt_tp, dp, dp_cp,
    expt_dp, ...), handed to megatron modules that accept it.
    """

    config: ParallelConfig
    pgs: object
    world_size: int
    rank: int

    @property
    def tp_group(self):
        return self.pgs.tp

    @property
    def cp_group(self):
        return self.pgs.cp

    @property
    def pp_group(self):
        return self.pgs.pp

    @property
    def ep_group(self):
        return self.pgs.ep

    @property
    def etp_group(self):
        return self.pgs.expt_tp

    @property
    def dp_group(self):
        return self.pgs.dp

    @property
    def dp_cp_group(self):
        return self.pgs.dp_cp

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp_group)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)

    @property
    def dp_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.config.pp - 1


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment (or as a single process).

    backend: None picks NCCL when CUDA is available, else gloo.
    Returns (rank, world_size). Idempotent.
    """
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if os.environ["WORLD_SIZE"] == "1":
            # one process has no one to meet: an in-memory store, where a TCP store would listen on
            # every interface, unauthenticated, for the whole run
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def init_parallel(config: ParallelConfig, seed: int = 1234) -> ParallelGroups:
    """Build megatron-core's model-parallel groups for `config` and seed its RNG tracker.

    torch.distributed must be initialised (init_distributed). On CPU the platform workarounds
    must already be applied (megatron's RNG tracker calls CUDA otherwise).
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    world = dist.get_world_size()
    config.data_parallel_size(world)  # the layout fits the world (also checked by the config at start-up)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tp,
        pipeline_model_parallel_size=config.pp,
        context_parallel_size=config.cp,
        expert_model_parallel_size=config.ep,
        expert_tensor_parallel_size=config.expert_tensor_parallel_size,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelGroups(config=config, pgs=ProcessGroupCollection.use_mpu_process_groups(),
                          world_size=world, rank=dist.get_rank())


def destroy_parallel() -> None:
    """Tear down megatron's groups and the default process group (end of a run or test).

    Every group must become unreachable, or a process that initialises again keeps the old ones:
    a gloo group holds two threads and a socket pair per peer until it is freed. Two references
    outlive megatron's own `destroy_model_parallel`, and are dropped here: globals of
    `parallel_state` that it does not reset (0.16.1 leaves `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`
    and its gloo twin; any global still holding a group is cleared, whatever its name), and the
    process-wide `lru_cache` on the rotary embeddings' forward, which holds up to 32 modules, each
    with its CP group. The models themselves: trainer.stack.release_model.
    """
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    parallel_state.destroy_model_parallel()
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    for cls in (rotary_pos_embedding.RotaryEmbedding, yarn_rotary_pos_embedding.YarnRotaryEmbedding):
        cache_clear = getattr(cls.forward, "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    if dist.is_initialized():
        dist.destroy_process_group()
