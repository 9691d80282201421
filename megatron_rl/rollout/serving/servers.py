"""The servers of an engine as configured: one RemoteServer per URL, or the launched ones (each
made by the engine kind, which knows its interpreter, flags and environment), and how a machine's
GPUs and cores are split over a pool of launched servers.

    servers = make_servers(cfg, root, dialect, launched, key_hint)   # cfg: ServingConfig
    launched(k, log_path) -> server k    # vLLM's: rollout/vllm/env.py make_servers (local_server)
    server_devices(visible, k, per_server, servers); server_cores(cores, k, servers); shared_gpu(...)

`cfg.urls` gives one RemoteServer per URL (never restarted by us); otherwise `cfg.num_servers`
launched servers, server k logging to `<root>/server.log` (k = 0) or `<root>/server{k}.log`.
Nothing starts here: a server starts at the engine's first weight sync (fleet.py).

Cost: pure; nothing grows with model or batch.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from megatron_rl.rollout.serving.config import ServingConfig
from megatron_rl.rollout.serving.dialect import Dialect
from megatron_rl.rollout.serving.errors import UnsupportedError
from megatron_rl.rollout.serving.handle import ServerHandle
from megatron_rl.rollout.serving.launcher import RemoteServer


def make_servers(cfg: ServingConfig, root: str, dialect: Dialect,
                 launched: Callable[[int, str], ServerHandle] | None, key_hint: str = "its API key") -> list[ServerHandle]:
    """The servers of `cfg`: a RemoteServer per URL (with cfg.api_key; `key_hint` says where its key
    is set), else `launched(k, log_path)` for k < num_servers (None only with URLs: finding a
    launched server's environment may cost)."""
    if cfg.urls or launched is None:
        if not cfg.urls:
            raise ValueError("no server URLs and nothing to launch them with")
        return [RemoteServer(u, cfg.health_timeout_s, api_key=cfg.api_key, health_path=dialect.health_path,
                             kind=dialect.name, key_hint=key_hint) for u in cfg.urls]
    return [launched(k, os.path.join(root, "server.log" if k == 0 else f"server{k}.log"))
            for k in range(cfg.num_servers)]


def server_cores(cores: list[int], k: int, servers: int) -> str:
    """The CPU cores of launched server k of a pool: the k-th of `servers` runs of `cores` (this
    process's CPUs), "a,b,..."; the last takes what is left, and with fewer cores than servers they
    share round-robin. (vLLM's own binding, "auto", knows of no other server: each keeps the last
    core for the rest of its process and binds its threads to the others, so every server of a
    pool would compute on the same cores; its VLLM_CPU_OMP_THREADS_BIND takes this.)"""
    if len(cores) < servers:
        return str(cores[k % len(cores)])
    per = len(cores) // servers
    mine = cores[k * per:] if k == servers - 1 else cores[k * per:(k + 1) * per]
    return ",".join(map(str, mine))


def shared_gpu(server_visible: str | None, per_server: int, trainer_visible: str | None, trainer_gpu: int) -> str | None:
    """The GPU (as CUDA_VISIBLE_DEVICES names it) that a server on the first `per_server` devices of
    `server_visible` shares with the trainer's CUDA device `trainer_gpu` of `trainer_visible`
    (None = every device, in order), or None."""
    trainer = trainer_visible.split(",") if trainer_visible else None
    mine = (trainer[trainer_gpu] if trainer else str(trainer_gpu)).strip()
    server = server_visible.split(",")[:per_server] if server_visible else [str(d) for d in range(per_server)]
    return mine if mine in {d.strip() for d in server} else None


def server_devices(visible: str | None, k: int, per_server: int, servers: int, *, section: str) -> str:
    """CUDA_VISIBLE_DEVICES of launched server k: the k-th run of `per_server` devices of
    `visible` (the devices given, "0,1,..."; None = 0..servers * per_server - 1). `section`: where
    num_servers and tensor_parallel_size are set (named in the refusal)."""
    devices = visible.split(",") if visible else [str(d) for d in range(servers * per_server)]
    if len(devices) < servers * per_server:
        raise UnsupportedError(f"{section}.num_servers={servers} x tensor_parallel_size={per_server} needs "
                               f"{servers * per_server} GPUs, CUDA_VISIBLE_DEVICES gives {len(devices)} "
                               f"({visible}); lower num_servers, or connect to servers on other nodes "
                               f"({section}.urls)")
    return ",".join(devices[k * per_server:(k + 1) * per_server])
