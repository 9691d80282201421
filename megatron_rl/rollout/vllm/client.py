"""`VllmEngine`: the RolloutEngine contract on one vLLM OpenAI-compatible server or a pool of them.

    engine = VllmEngine(arch, VllmConfig(dtype="float32"), run_dir="runs/x", weight_sync="memory")
    engine.update_weights(named_tensors, version=0)    # in memory (the `memory` transport's; weight_sync=memory)
    engine.load_weights_from(model_dir, version=0)     # or an HF folder (the `disk` transport's; reload / restart)
                                                       # the first weights start the servers
    groups = engine.generate(prompts, n=8, sampling=SamplingParams(max_tokens=64))
    engine.abort() | engine.pause(); ...; engine.resume()   # train.in_flight_update=abort | pause, from another thread
    engine.stats()   # {"vllm/restarts": 0, "vllm/retries": 0, "vllm/bad_responses": 0, ...}
    engine.close()

It assembles vLLM's parts (its dialect, its config as the serving layer's ServingConfig, its
weight receivers, its environment) with the engine-agnostic serving layer (rollout/serving/),
whose modules do the work, one job each:

    env.py (here)          the servers as configured: flags, environment, devices (nothing starts)
    serving/pool.py        which server takes the next request; each server's state and counters
    serving/fleet.py       starting the servers, taking a failed one out and restarting it; the counters
    serving/generation.py  requests as coroutines: retries, failover, abort or pause for a weight update
    serving/updates.py     weight syncs (memory: transfer.push_all / disk) and the parity probe after them

Servers. `rollout.vllm.num_servers` launched ones or the `urls` given (pool.py): every sync
reaches each of them, and each request goes to the ready one with the least work in flight.

Cost: the serving layer's (generation.py, updates.py); building it is O(servers).
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.serving.dialect import Dialect
from megatron_rl.rollout.serving.errors import UnsupportedError
from megatron_rl.rollout.serving.fleet import Fleet
from megatron_rl.rollout.serving.generation import Generation
from megatron_rl.rollout.serving.handle import ServerHandle
from megatron_rl.rollout.serving.pool import Replica, ServerPool
from megatron_rl.rollout.serving.probe import Reference
from megatron_rl.rollout.serving.receivers import WeightDirs
from megatron_rl.rollout.serving.updates import WeightUpdates
from megatron_rl.rollout.types import Request, Sample, SamplingParams, check_prompts, grouped, requests_of
from megatron_rl.rollout.vllm.config import VllmConfig
from megatron_rl.rollout.vllm.dialect import VLLM_DIALECT
from megatron_rl.rollout.vllm.env import make_servers
from megatron_rl.rollout.vllm.protocol import check_served, decode_routed_experts
from megatron_rl.rollout.vllm.transfer import backend_for, nccl_needs_vllm, push_all
from megatron_rl.rollout.vllm.weight_sync import TAKES, check_supported

__all__ = ["VllmEngine"]


class VllmEngine:
    """RolloutEngine backed by vLLM servers (launched here, or `cfg.url` / `cfg.urls`).

    arch: the policy's architecture (vocab size, MoE or not). cfg: VllmConfig; its "auto"
    fields should be resolved by the caller (make_vllm_engine does it): here dtype "auto" lets
    vLLM use the checkpoint's dtype and logprobs_mode "auto" means raw_logprobs.
    run_dir: server logs (`<run_dir>/vllm/server.log`, `server1.log`, ... for a pool).
    weight_sync: how weights arrive, a name the dialect takes (rollout.weight_sync, resolved; the trainer
        sends by its transport, trainer/transport.py): "memory" streams tensors into
        update_weights (transfer.py); "reload" and "restart" take HF folders in
        load_weights_from (weight_sync.py), of which the engine keeps the newest keep_weight_dirs.
    reference: the parity probe's reference (tokens -> log-probs [len - 1]); None = transformers
        fp32 on the weights' folder.
    server, device: inject a ServerHandle (tests; a list of them for a pool) and its device
        ("cpu" | "cuda" | "unknown").
    stopping: the trainer's stop flag; no server is restarted once it is true (fleet.py).
    dialect: the servers' kind (rollout/serving/dialect.py): their command line, health path and
        generate requests, its abort, pause and resume calls, and the weight syncs it takes with their
        receivers (default vLLM's, rollout/vllm/dialect.py).

    Configurations that would give wrong numbers are refused here, before anything starts
    (UnsupportedError): MoE + in-place reload on CPU, routed experts (R3) on CPU. The servers
    start at the first sync, on those weights.

    Cost: one request per sample spread over the servers, a coroutine each on one event loop
    thread, at most max_concurrency in flight per server (generation.py);
    per sync, each server loads the whole model and answers one parity probe (updates.py).
    """

    def __init__(self, arch: ModelArch, cfg: VllmConfig | None = None, run_dir: str = "runs/vllm", *,
                 weight_sync: str = TAKES[0], reference: Reference | None = None,
                 server: ServerHandle | list[ServerHandle] | None = None,
                 device: str | None = None, stopping: Callable[[], bool] = lambda: False,
                 dialect: Dialect = VLLM_DIALECT):
        self.arch = arch
        self.dialect = dialect
        cfg = cfg or VllmConfig()
        if weight_sync not in dialect.weight_syncs:
            raise ValueError(f"rollout.weight_sync={weight_sync!r}: {dialect.name} servers take "
                             f"{', '.join(dialect.weight_syncs)}")
        self.weight_sync = weight_sync
        # with CUDA the trainer drives vLLM's own nccl engine: refused before anything starts
        self.backend = backend_for(torch.cuda.is_available()) if weight_sync == "memory" else None
        if self.backend is not None and self.backend.name == "nccl" and importlib.util.find_spec("vllm") is None:
            raise UnsupportedError(nccl_needs_vllm())
        self.cfg = cfg
        self.root = os.path.join(run_dir, "vllm")
        self.logprobs_mode = "raw_logprobs" if cfg.logprobs_mode == "auto" else cfg.logprobs_mode
        self.max_model_len = cfg.max_model_len or arch.max_position_embeddings
        self.max_logprobs = cfg.max_logprobs or min(arch.vocab_size, 64)
        self.policy_version = -1
        self.reference = reference
        servers = [server] if server is not None and not isinstance(server, list) else server
        if servers is None:
            nccl = self.backend is not None and self.backend.name == "nccl"  # this rank sends: its GPU
            servers, device = make_servers(arch, cfg, weight_sync, self.root, device, self.backend,
                                           self.max_model_len, self.logprobs_mode, self.max_logprobs,
                                           torch.cuda.current_device() if nccl else None, dialect)
        self.device = device or (cfg.device if cfg.device != "auto" else "unknown")
        for s in servers:
            check_supported(arch, weight_sync, self.device, cfg.enable_return_routed_experts, s.can_restart)
        pool = ServerPool([Replica(k, s, dialect.memory_receiver(s, self.backend, cfg.bucket_bytes, cfg.transfer_host)
                                   if self.backend else None) for k, s in enumerate(servers)], cfg.affinity, dialect.name)
        serving = cfg.serving()  # what the serving layer reads of rollout.vllm
        self.fleet = Fleet(arch, serving, self.root, pool, stopping, dialect)
        self.generation = Generation(arch, serving, self.fleet, self.max_model_len, self.max_logprobs,
                                     check_sampling=lambda s: check_served(self.logprobs_mode, s, arch.vocab_size),
                                     decode_routed=decode_routed_experts)
        self.updates = WeightUpdates(arch, serving, weight_sync, self.fleet, push_all if self.backend else None,
                                     self.max_model_len)

    @property
    def max_len(self) -> int:
        return self.max_model_len

    @property
    def pool(self) -> ServerPool:
        return self.fleet.pool

    @property
    def replicas(self) -> list[Replica]:
        return self.fleet.replicas

    @property
    def server(self) -> ServerHandle:
        """The first server (the only one without a pool)."""
        return self.fleet.replicas[0].server

    @property
    def dirs(self) -> WeightDirs:
        return self.fleet.dirs

    @property
    def stopping(self) -> Callable[[], bool]:
        return self.fleet.stopping

    @stopping.setter
    def stopping(self, flag: Callable[[], bool]) -> None:
        self.fleet.stopping = flag

    # ---- weights (updates.py) -----------------------------------------------------------------
    def update_weights(self, named_tensors, version: int) -> None:
        """Stream HF checkpoint-format (name, tensor) pairs into every server (weight_sync=memory,
        transfer.py; the first call starts them on random weights; a server restarted since the
        last sync (STALE) is included, and READY after it), probe parity on each against the
        same stream, then set policy_version. Raises ParityError when a probe differs by more
        than the tolerance, ServerDiedError when the transfer fails (the servers are left
        paused and half updated: the run stops)."""
        self.updates.update_weights(named_tensors, version, self.reference)
        self.policy_version = version

    def load_weights_from(self, model_dir: str, version: int) -> None:
        """Make every server serve the HF folder `model_dir` (start them on the first one; then
        reload in place or restart, as weight_sync says, all at once; a server that is down
        is restarted on it), probe parity on each against the reference, then set
        policy_version. The engine owns the folder from now on. Raises ParityError when a
        probe differs by more than the tolerance; ServerDiedError when no server took it."""
        self.updates.load_weights_from(model_dir, version, self.reference)
        self.policy_version = version

    # ---- generation (generation.py) -----------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Sample]]:
        """n samples per prompt; result[i][j] is sample j of prompt i (generation.py). Raises
        GenerationAborted when abort() ends it."""
        check_prompts(prompts, n, self.arch.vocab_size)
        return grouped(self.generate_requests(requests_of(prompts, n, sampling)), len(prompts), n)

    def generate_requests(self, requests: Sequence[Request]) -> list[Sample]:
        """One sample per request, in order (each request's own sampling settings and stream),
        spread over the servers as single requests (generation.py). Raises GenerationAborted when
        abort() ends it."""
        return self.generation.generate(requests, lambda: self.policy_version)

    async def sample(self, request: Request) -> Sample:
        """One request's sample, awaited from any event loop; it comes back as soon as its answer does
        (engine.py `SamplesEach`; rollout/requests.py awaits each request of a rollout so). Raises
        GenerationAborted when abort() ends it."""
        return await self.generation.sample(request, lambda: self.policy_version)

    def abort(self) -> None:
        """Make the generate() call in flight raise GenerationAborted; return once it has ended,
        none of its requests still running (at once when none runs). No call starts until
        resume(). (train.in_flight_update=abort: the weights are pushed in between.)"""
        self.generation.abort()

    def pause(self) -> None:
        """Freeze the generate() call in flight on every server (vLLM's /pause?mode=keep); return once
        they all are (at once when none runs). No call starts until resume(). The weights pushed
        meanwhile make the rest of its tokens, and each sample says which version made which
        token (Sample.token_versions). (train.in_flight_update=pause: partial rollouts.)"""
        self.generation.pause()

    def resume(self) -> None:
        """After abort() or pause(): calls start again and frozen requests go on; then the parity
        probe of a sync made while paused (ParityError)."""
        self.generation.resume()
        self.updates.after_resume()

    # ---- bookkeeping --------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters since construction (vllm/restarts, vllm/retries, vllm/bad_responses,
        vllm/requests, vllm/weight_syncs: pool totals; vllm/aborts, vllm/pauses once a call was
        aborted, paused) and the last values of vllm/probe_max_abs_diff (the largest over the servers) and
        timing/vllm_{server_start,restart,reload,memory_sync,weight_sync} (seconds); for a pool,
        per server k: vllm/server{k}/{requests,tokens,restarts,ready,tokens_per_s (over the last burst of
        calls: from one in flight to none, generate() or sample()), probe_max_abs_diff}."""
        return {**self.fleet.stats, **self.fleet.pool.stats()}

    def close(self) -> None:
        """Stop the requests' loop, the servers (if ours), and delete the weight folders it was given."""
        self.generation.close()
        self.fleet.close()
