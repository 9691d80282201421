"""A `gloo` weight-transfer engine for vLLM's RL API: in-memory weight sync to a CPU server.

vLLM's weight-transfer API (vllm/distributed/weight_transfer/) moves the trainer's weights into
the server's workers without a file: the trainer POSTs /init_weight_transfer_engine once, then per
sync /start_weight_update, one /update_weights per bucket (its tensors' names, dtypes and shapes)
while it broadcasts the bucket's bytes to the workers, and /finish_weight_update. Its `nccl`
engine needs CUDA (PyNcclCommunicator, CUDA streams) and so does the base class's update_weights
(torch.accelerator.synchronize()): on a CPU server none of its engines can receive. This engine
speaks the same protocol (the update info is vLLM's own NCCLWeightTransferUpdateInfo, the bytes
are packed the way vLLM's packed broadcast packs them) over a gloo process group instead:

    init_info  {master_address, master_port, rank_offset, world_size, timeout_s, store_token}
               the trainer hosts the rendezvous store at master_address:master_port (it answers
               only a connection that opens with store_token: megatron_rl_vllm_store.py) and is
               rank 0; worker w
               of the server joins as rank_offset + w (w = dp_rank * TP * PP + its rank, as vLLM's
               nccl engine numbers them), so several servers share one group with their offsets.
    update     {names, dtype_names, shapes}: the tensors of one bucket, in order. The worker
               receives the bucket as one broadcast of their bytes back to back (a uint8 tensor,
               what vLLM's packed broadcast sends per chunk) and loads its views into the model.
               The trainer bounds the bucket, so one update is one broadcast whatever its size.

MoE on the CPU: vLLM's unquantized MoE method prepacks the expert weights for its CPU kernel only
on the first load (process_weights_after_loading skips it when `moe_kernel` is already set, to
keep parameter addresses stable for CUDA graphs), so an in-place update leaves the kernel on the
old experts. `start_weight_update` therefore drops `quant_method.moe_kernel` of every MoE layer of
a CPU model before the layerwise reload, which then prepacks as a first load does. Not on CUDA,
where the captured addresses matter and the update needs no prepack.

Loading it into a server (the launcher does this for the servers it starts):

    PYTHONPATH=<this directory> VLLM_SERVER_DEV_MODE=1 vllm serve <model> \\
        --weight-transfer-config '{"backend": "gloo"}' \\
        --worker-extension-cls megatron_rl_vllm_gloo.RegistersGlooEngine

The worker extension has no methods: naming it makes every worker process import this module,
whose import registers the engine in vLLM's WeightTransferEngineFactory before the worker builds
its engine. Cost per sync: the model's bytes once through the trainer's socket per worker (gloo
broadcast), one bucket's buffer per worker while it loads.

Profiling: with MEGATRON_RL_VLLM_SYNC_PROFILE_DIR set in the server's environment (the benchmark's
--profile-dir), each worker writes a cProfile of every sync, start_weight_update to
finish_weight_update, to <dir>/sync-p<pid>-w<worker>-<n>.prof (n = 0 is the first sync). It
includes the time the worker waits for the trainer between updates.

Runs in the vLLM environment (vllm, torch); nothing of megatron_rl is imported.
"""
from __future__ import annotations

import cProfile
import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron_rl_vllm_store import SecretStoreClient  # this directory (server_plugin/__init__.py)
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

BACKEND = "gloo"
PROFILE_DIR_ENV = "MEGATRON_RL_VLLM_SYNC_PROFILE_DIR"  # benchmarks/weight_sync.py --profile-dir sets it


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """The /init_weight_transfer_engine payload (see the module docstring)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0
    store_token: str = ""


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, NCCLWeightTransferUpdateInfo]):
    """Receives the trainer's broadcasts over gloo into CPU buffers and loads them through the
    model's layerwise reload (vLLM's lifecycle for checkpoint-format weights)."""

    init_info_cls = GlooInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroup | None = None
        self.profile_dir = os.environ.get(PROFILE_DIR_ENV)
        self.profiler: cProfile.Profile | None = None
        self.syncs = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        # a store and group of its own: the worker's default process group is vLLM's
        store = SecretStoreClient(init_info.master_address, init_info.master_port, init_info.store_token,
                                  init_info.timeout_s)
        try:
            self.group = dist.ProcessGroupGloo(store, rank, init_info.world_size, timeout)
        finally:
            store.close()  # the trainer closes it too once every worker has joined

    def start_weight_update(self) -> None:
        if self.profile_dir:  # one cProfile per sync, start to finish (the receive included)
            self.profiler = cProfile.Profile()
            self.profiler.enable()
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if torch.device(self.device).type == "cpu":
            for module in self.model.modules():
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "moe_kernel"):
                    method.moe_kernel = None  # the reload then prepacks the new experts (module docstring)
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if self.profiler is not None:
            self.profiler.disable()
            rank = self.parallel_config.data_parallel_index * self.parallel_config.world_size + self.parallel_config.rank
            name = f"sync-p{os.getpid()}-w{rank}-{self.syncs}.prof"  # the pid: one server after another
            self.profiler.dump_stats(os.path.join(self.profile_dir, name))
            self.profiler = None
        self.syncs += 1

    def update_weights(self, update_info: dict) -> None:
        # not the base class's: it ends in torch.accelerator.synchronize(), which a CPU lacks;
        # gloo's wait() has already returned the bytes
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialised: POST /init_weight_transfer_engine first")
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(update_info.shapes, dtypes)]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)  # CPU: a CUDA model's load_weights copies it over
        self.group.broadcast(buffer, 0).wait()
        with disable_mtp_completeness_check():
            self.model.load_weights(unpack_tensor(buffer, update_info.names, update_info.shapes, dtypes, sizes))

    def shutdown(self) -> None:
        self.group = None  # a gloo group closes its connections when its last reference goes


class RegistersGlooEngine:
    """The `--worker-extension-cls` that makes each worker import this module (no methods)."""


if BACKEND not in WeightTransferEngineFactory._registry:  # vLLM's factory has no lookup but its dict
    WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
