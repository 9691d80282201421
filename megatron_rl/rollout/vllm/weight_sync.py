"""Getting new weights into the vLLM server: export to disk, then one `WeightSync` backend.

    store = WeightStore(root, arch, keep=2)
    model_dir = store.write(named_tensors, version)     # atomic: temp dir + rename
    DiskReloadSync().apply(server, model_dir)          # /collective_rpc reload_weights + reset_prefix_cache
    RestartSync().apply(server, model_dir)             # stop; start a fresh server on model_dir

Backends:
- `DiskReloadSync` (dense models; any device): vLLM's `reload_weights` collective RPC reads the
  new safetensors in place (VLLM_SERVER_DEV_MODE=1), then the prefix cache (KV computed with
  the old weights) is dropped. Both requests carry the server's key: the development endpoints
  are open only to it (see launcher.py, Access). ~0.05 s for a tiny model on CPU, plus the export.
- `RestartSync` (MoE on CPU): vLLM's CPU backend reloads MoE experts wrongly in place, so the
  server is restarted on the new directory, which is always correct but costs a full start
  (~50 s on a 2-core CPU). Measured as `timing/vllm_restart`.

Planned, not implemented (GPU): an `NcclSync` through vLLM's RL weight-transfer endpoints
(`/init_weight_transfer_engine` once, then `/update_weights` per step with an NCCL broadcast from
trainer rank 0, no disk) and an `IpcSync` for a colocated server (CUDA IPC handles of the
trainer's gathered tensors). Both fit the `apply(server, source)` shape below; they need a GPU
to be tested, so they are not here yet.
"""
from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterable
from typing import Protocol

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.model.hf_io import save_hf_checkpoint
from megatron_rl.rollout.vllm.errors import VllmError, VllmUnsupportedError
from megatron_rl.rollout.vllm.http import request_json
from megatron_rl.rollout.vllm.launcher import ServerHandle

log = logging.getLogger("megatron_rl.rollout.vllm")

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attention


class WeightStore:
    """Exported HF-format weight directories under `root`, oldest first.

    Directory names are `<tag>-<n>-v<version>` with a tag unique to this store, so two engines
    sharing a run directory never touch each other's files.
    """

    def __init__(self, root: str, arch: ModelArch, keep: int = 2):
        self.root, self.arch, self.keep = root, arch, keep
        self.tag = uuid.uuid4().hex[:8]
        self.dirs: list[str] = []
        self._n = 0

    @property
    def latest(self) -> str | None:
        return self.dirs[-1] if self.dirs else None

    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> str:
        """Write the (name, tensor) pairs as a complete model directory (config.json +
        safetensors) atomically; its path."""
        self._n += 1
        path = os.path.join(self.root, f"{self.tag}-{self._n:05d}-v{version}")
        save_hf_checkpoint(path, self.arch, named_tensors)
        self.dirs.append(path)
        return path

    def prune(self) -> None:
        """Delete all but the newest `keep` directories."""
        while len(self.dirs) > self.keep:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def clear(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs = []


class WeightSync(Protocol):
    """Make a running server serve the weights in `model_dir` (written by WeightStore)."""

    name: str

    def apply(self, server: ServerHandle, model_dir: str, timeout: float) -> float:
        """Returns the seconds it took. Transport failures propagate (the client restarts)."""


class DiskReloadSync:
    """In-place reload from disk through vLLM's `reload_weights` collective RPC (dense models)."""

    name = "reload"

    def apply(self, server: ServerHandle, model_dir: str, timeout: float) -> float:
        import time

        t0 = time.perf_counter()
        out = request_json(server.url + "/collective_rpc",
                           {"method": "reload_weights", "kwargs": {"weights_path": os.path.abspath(model_dir)}},
                           timeout=timeout, api_key=server.api_key)
        if not isinstance(out, dict) or "results" not in out:
            raise VllmError(f"/collective_rpc reload_weights answered {out!r:.300}; is the server running with "
                            f"VLLM_SERVER_DEV_MODE=1?")
        request_json(server.url + "/reset_prefix_cache", {}, timeout=timeout, api_key=server.api_key)
        return time.perf_counter() - t0


class RestartSync:
    """Restart the server on the new weights: slow, but a fresh load is always right."""

    name = "restart"

    def apply(self, server: ServerHandle, model_dir: str, timeout: float) -> float:
        seconds = server.restart(model_dir)
        log.info("vLLM weight sync by restart took %.1f s (%s)", seconds, model_dir)
        return seconds


def check_supported(arch: ModelArch, weight_sync: str, device: str, routed_experts: bool,
                    can_restart: bool) -> None:
    """Refuse configurations that would train on wrong numbers, before any server starts.

    device: "cpu" | "cuda" | "unknown" (a server at a URL we were not told about: treated as CPU).
    """
    on_cpu = device != "cuda"
    if device == "cpu" and arch.family.mla:
        raise VllmUnsupportedError(
            f"model.arch={arch.arch} (multi-latent attention) is refused on vLLM's CPU backend: its CPU MLA path "
            "computes other log-probs than transformers from the same checkpoint (vLLM 0.32.0: equal at the first "
            "position, off by 0.05 to 0.44 nats after it in our probes: attention across positions differs). Use the embedded "
            "engine (rollout.backend=embedded) on CPU, or a GPU vLLM server (rollout.vllm.device=cuda).")
    if device == "cpu" and arch.head_dim not in CPU_HEAD_DIMS:
        raise VllmUnsupportedError(f"vLLM's CPU attention supports head_dim in {CPU_HEAD_DIMS}, the model has "
                                   f"head_dim={arch.head_dim}; set model.overrides.head_dim (e.g. 32)")
    where = "vLLM's CPU backend" if device == "cpu" else "a vLLM server of unknown device (say rollout.vllm.device=cuda for a GPU server)"
    if arch.is_moe and weight_sync == "reload" and on_cpu:
        raise VllmUnsupportedError(
            f"in-place weight reload of a MoE model is refused on {where}: vLLM's CPU backend leaves the expert "
            f"weights wrong after reload_weights (checksums differ from a fresh load), so rollouts would come "
            f"from a different policy than the trainer's. Use rollout.vllm.weight_sync=restart (RestartSync: "
            f"restarts the server on the new weights every sync, ~1 min each on a 2-core CPU, timed as "
            f"timing/vllm_restart), or run the server on GPUs.")
    if weight_sync == "restart" and not can_restart:
        raise VllmUnsupportedError("rollout.vllm.weight_sync=restart needs a server we launch; it cannot "
                                   "restart the server at rollout.vllm.url")
    if routed_experts:
        if not arch.is_moe:
            raise VllmUnsupportedError("routed-expert capture (router replay R3) was requested for a dense model")
        if on_cpu:
            raise VllmUnsupportedError(
                f"router replay R3 needs the rollout engine's routed experts, and {where} cannot return them: "
                f"vLLM's enable_return_routed_experts needs Model Runner V2 with Triton (GPU) and fails on CPU. "
                f"Use the embedded engine (rollout.backend=embedded) for R3 on CPU, R2 (replay the trainer's own "
                f"routing), or a GPU vLLM server.")
