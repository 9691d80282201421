"""The weight syncs the vLLM engine takes, and making a server serve new weights from an HF model
folder: one disk receiver (serving/receivers.py DiskReceiver) per disk sync.

    sync.apply(server, model_dir, timeout, warmup)   # -> {"timing/vllm_reload": s} or {"timing/vllm_restart": s}

The folder comes from the trainer's weight transport (trainer/transport.py: `disk` writes it and
hands it to VllmEngine.load_weights_from); the engine owns it from then on (serving/receivers.py
`WeightDirs`: the newest `keep` stay, for restarts and the parity probe's reference).

TAKES, the rollout.weight_sync names it takes (rollout/registered.py registers each; the first is
its default): "memory" (transfer.py), "reload" and "restart" (below). Backends:
- `DiskReloadSync` (dense models; any device): vLLM's `reload_weights` collective RPC reads the
  new safetensors in place (VLLM_SERVER_DEV_MODE=1), then the prefix cache (KV computed with
  the old weights) is dropped. Both requests carry the server's key: the development endpoints
  are open only to it (see serving/launcher.py, Access). ~0.05 s for a tiny model on CPU, plus the write.
- `RestartSync` (MoE on CPU, from disk): vLLM's CPU backend reloads MoE experts wrongly in
  place from a folder (its CPU kernel keeps the experts it prepacked at the first load; the
  in-memory sync repacks them, see server_plugin/megatron_rl_vllm_gloo.py), so the server is
  restarted on the new folder, which is always correct but costs a full start (~50 s on a
  2-core CPU). Measured as `timing/vllm_restart`.

These are the disk fallbacks: the default, rollout.weight_sync=memory, streams the tensors
into the server with no folder and no restart (transfer.py, MemorySync; MoE included).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.serving.errors import ServingError, UnsupportedError
from megatron_rl.rollout.serving.handle import ServerHandle
from megatron_rl.rollout.serving.http import request_json

log = logging.getLogger("megatron_rl.rollout.vllm")

TAKES = ("memory", "reload", "restart")
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attention


class DiskReloadSync:
    """In-place reload from disk through vLLM's `reload_weights` collective RPC (dense models)."""

    def apply(self, server: ServerHandle, model_dir: str, timeout: float,
              warmup: Callable[[], None]) -> dict[str, float]:
        t0 = time.perf_counter()
        out = request_json(server.url + "/collective_rpc",
                           {"method": "reload_weights", "kwargs": {"weights_path": os.path.abspath(model_dir)}},
                           timeout=timeout, api_key=server.api_key)
        if not isinstance(out, dict) or "results" not in out:
            raise ServingError(f"/collective_rpc reload_weights answered {out!r:.300}; is the server running with "
                               f"VLLM_SERVER_DEV_MODE=1?")
        request_json(server.url + "/reset_prefix_cache", {}, timeout=timeout, api_key=server.api_key)
        return {"timing/vllm_reload": time.perf_counter() - t0}


class RestartSync:
    """Restart the server on the new weights: slow, but a fresh load is always right."""

    def apply(self, server: ServerHandle, model_dir: str, timeout: float,
              warmup: Callable[[], None]) -> dict[str, float]:
        seconds = server.restart(model_dir)
        warmup()
        log.info("vLLM weight sync by restart took %.1f s (%s)", seconds, model_dir)
        return {"timing/vllm_restart": seconds}


def check_supported(arch: ModelArch, weight_sync: str, device: str, routed_experts: bool,
                    can_restart: bool) -> None:
    """Refuse configurations that would train on wrong numbers, before any server starts.

    device: "cpu" | "cuda" | "unknown" (a server at a URL we were not told about: treated as CPU).
    """
    on_cpu = device != "cuda"
    if device == "cpu" and arch.family.mla:
        raise UnsupportedError(
            f"model.arch={arch.arch} (multi-latent attention) is refused on vLLM's CPU backend: its CPU MLA path "
            "computes other log-probs than transformers from the same checkpoint (vLLM 0.32.0: equal at the first "
            "position, off by 0.05 to 0.44 nats after it in our probes: attention across positions differs). Use the embedded "
            "engine (rollout.backend=embedded) on CPU, or a GPU vLLM server (rollout.vllm.device=cuda).")
    if device == "cpu" and arch.head_dim not in CPU_HEAD_DIMS:
        raise UnsupportedError(f"vLLM's CPU attention supports head_dim in {CPU_HEAD_DIMS}, the model has "
                               f"head_dim={arch.head_dim}; set model.overrides.head_dim (e.g. 32)")
    where = "vLLM's CPU backend" if device == "cpu" else "a vLLM server of unknown device (say rollout.vllm.device=cuda for a GPU server)"
    if arch.is_moe and weight_sync == "reload" and on_cpu:
        raise UnsupportedError(
            f"in-place weight reload of a MoE model is refused on {where}: vLLM's CPU backend leaves the expert "
            f"weights wrong after reload_weights (checksums differ from a fresh load), so rollouts would come "
            f"from a different policy than the trainer's. Use rollout.weight_sync=memory (the default: the "
            f"in-memory sync repacks the experts), or rollout.weight_sync=restart (RestartSync: "
            f"restarts the server on the new weights every sync, ~1 min each on a 2-core CPU, timed as "
            f"timing/vllm_restart), or run the server on GPUs.")
    if weight_sync == "restart" and not can_restart:
        raise UnsupportedError("rollout.weight_sync=restart needs a server we launch; it cannot "
                               "restart the server at rollout.vllm.url")
    if routed_experts:
        if not arch.is_moe:
            raise UnsupportedError("routed-expert capture (router replay R3) was requested for a dense model")
        if on_cpu:
            raise UnsupportedError(
                f"router replay R3 needs the rollout engine's routed experts, and {where} cannot return them: "
                f"vLLM's enable_return_routed_experts needs Model Runner V2 with Triton (GPU) and fails on CPU. "
                f"Use the embedded engine (rollout.backend=embedded) for R3 on CPU, R2 (replay the trainer's own "
                f"routing), or a GPU vLLM server.")
