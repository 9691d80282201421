"""The servers of a VllmEngine as configured: their command-line flags (the dialect's), environment and devices.

    servers, device = make_servers(arch, cfg, weight_sync, root, device, backend, max_model_len, logprobs_mode,
                                   max_logprobs, dialect=VLLM_DIALECT)

`rollout.vllm.urls` gives one RemoteServer per URL (never restarted by us); otherwise
`num_servers` LocalServers are launched from the vLLM environment (env.py), server k logging to
`<root>/server.log` (k = 0) or `<root>/server{k}.log`, on the k-th run of
`tensor_parallel_size` GPUs of CUDA_VISIBLE_DEVICES. Nothing starts here: a server starts at
the engine's first weight sync (fleet.py). A launched server on the trainer's own GPU is refused
with the in-memory sync over NCCL: NCCL takes no two ranks of one group on one device, so the
first sync would fail.

Cost: pure; nothing grows with model or batch.
"""
from __future__ import annotations

import os

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.serving.dialect import Dialect
from megatron_rl.rollout.serving.errors import UnsupportedError
from megatron_rl.rollout.serving.handle import ServerHandle
from megatron_rl.rollout.serving.launcher import HOST, RemoteServer
from megatron_rl.rollout.vllm.config import VllmConfig
from megatron_rl.rollout.vllm.dialect import VLLM_DIALECT
from megatron_rl.rollout.vllm.env import ENV_API_KEY, detect_device, ensure_vllm_python, local_server
from megatron_rl.rollout.vllm.weight_sync import check_supported


def make_servers(arch: ModelArch, cfg: VllmConfig, weight_sync: str, root: str, device: str | None, backend,
                 max_model_len: int, logprobs_mode: str, max_logprobs: int, trainer_gpu: int | None = None,
                 dialect: Dialect = VLLM_DIALECT) -> tuple[list[ServerHandle], str | None]:
    """The servers of cfg and their device: one RemoteServer per URL, else num_servers LocalServers
    (a configuration refused on the device is refused before the environment is looked for).
    weight_sync: how they take weights (rollout.weight_sync, resolved: memory, reload, restart).
    trainer_gpu: the CUDA device index of the rank that sends the weights, when it sends over NCCL.
    dialect: the server kind (rollout/serving): its flags, command line and health path."""
    if cfg.server_urls:
        key = cfg.api_key or os.environ.get(ENV_API_KEY) or None
        return ([RemoteServer(u, cfg.health_timeout_s, api_key=key, health_path=dialect.health_path, kind=dialect.name,
                              key_hint=f"rollout.vllm.api_key or ${ENV_API_KEY}") for u in cfg.server_urls],
                device or (cfg.device if cfg.device != "auto" else "unknown"))
    device = device or (cfg.device if cfg.device != "auto" else None)
    if device is not None:  # refuse before looking for (or installing) the environment
        check_supported(arch, weight_sync, device, cfg.enable_return_routed_experts, True)
    python = ensure_vllm_python(cfg.python)
    device = device or detect_device(python)
    if device == "cuda" and trainer_gpu is not None:
        check_own_gpus(cfg, trainer_gpu)
    receiver = dialect.receiver_flags(backend) if backend is not None else []  # started on random weights
    args = dialect.server_flags(cfg, max_model_len, logprobs_mode, max_logprobs, receiver)
    return [local_server(python, args, server_env(cfg, device, k, dev=weight_sync in ("reload", "memory")),
                         os.path.join(root, "server.log" if k == 0 else f"server{k}.log"),
                         cfg.startup_timeout_s, cfg.health_timeout_s, dialect=dialect)
            for k in range(cfg.num_servers)], device


def server_env(c: VllmConfig, device: str, k: int = 0, *, dev: bool) -> dict[str, str]:
    """The environment of launched server k. dev: open the development endpoints (/collective_rpc,
    the weight-transfer ones): only where the weight sync uses them (memory, reload; not restart)."""
    env = {"VLLM_HOST_IP": HOST, "VLLM_SERVER_DEV_MODE": "1" if dev else "0"}
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(c.kv_cache_space_gb)
    env.update(c.env)
    if device == "cuda" and c.num_servers > 1:
        env["CUDA_VISIBLE_DEVICES"] = server_devices(env.get("CUDA_VISIBLE_DEVICES")
                                                     or os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                     k, c.tensor_parallel_size, c.num_servers)
    if device == "cpu" and c.num_servers > 1 and c.tensor_parallel_size == 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        env["VLLM_CPU_OMP_THREADS_BIND"] = server_cores(cores, k, c.num_servers)
    return env


def server_cores(cores: list[int], k: int, servers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND of launched CPU server k of a pool: the k-th of `servers` runs of
    `cores` (this process's CPUs), "a,b,..."; the last takes what is left, and with fewer cores than
    servers they share round-robin. vLLM's own binding ("auto") knows of no other server: each keeps
    the last core for the rest of its process and binds its threads to the others, so every server of
    a pool would compute on the same cores."""
    if len(cores) < servers:
        return str(cores[k % len(cores)])
    per = len(cores) // servers
    mine = cores[k * per:] if k == servers - 1 else cores[k * per:(k + 1) * per]
    return ",".join(map(str, mine))


def check_own_gpus(cfg: VllmConfig, trainer_gpu: int) -> None:
    """Refuse launched servers that would run on the GPU of the trainer's sender (CUDA device
    `trainer_gpu`) when the weights go over NCCL (rollout.weight_sync=memory with CUDA)."""
    trainer_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    for k in range(cfg.num_servers):
        visible = server_env(cfg, "cuda", k, dev=False).get("CUDA_VISIBLE_DEVICES") or trainer_visible
        gpu = shared_gpu(visible, cfg.tensor_parallel_size, trainer_visible, trainer_gpu)
        if gpu is not None:
            raise UnsupportedError(
                f"rollout.weight_sync=memory with CUDA streams the weights over NCCL, which cannot join "
                f"the trainer's rank 0 and vLLM server {k} on one GPU ({gpu}): give the servers GPUs of their own "
                f"(fewer trainer ranks per node and rollout.vllm.env={{CUDA_VISIBLE_DEVICES: ...}}, or "
                f"rollout.vllm.urls), or set rollout.weight_sync=reload")


def shared_gpu(server_visible: str | None, per_server: int, trainer_visible: str | None, trainer_gpu: int) -> str | None:
    """The GPU (as CUDA_VISIBLE_DEVICES names it) that a server on the first `per_server` devices of
    `server_visible` shares with the trainer's CUDA device `trainer_gpu` of `trainer_visible`
    (None = every device, in order), or None."""
    trainer = trainer_visible.split(",") if trainer_visible else None
    mine = (trainer[trainer_gpu] if trainer else str(trainer_gpu)).strip()
    server = server_visible.split(",")[:per_server] if server_visible else [str(d) for d in range(per_server)]
    return mine if mine in {d.strip() for d in server} else None


def server_devices(visible: str | None, k: int, per_server: int, servers: int) -> str:
    """CUDA_VISIBLE_DEVICES of launched server k: the k-th run of `per_server` devices of
    `visible` (the devices given, "0,1,..."; None = 0..servers * per_server - 1)."""
    devices = visible.split(",") if visible else [str(d) for d in range(servers * per_server)]
    if len(devices) < servers * per_server:
        raise UnsupportedError(f"rollout.vllm.num_servers={servers} x tensor_parallel_size={per_server} needs "
                               f"{servers * per_server} GPUs, CUDA_VISIBLE_DEVICES gives {len(devices)} "
                               f"({visible}); lower num_servers, or connect to servers on other nodes "
                               f"(rollout.vllm.urls)")
    return ",".join(devices[k * per_server:(k + 1) * per_server])
