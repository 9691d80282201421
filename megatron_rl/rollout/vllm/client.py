"""`VllmEngine`: the RolloutEngine contract on one vLLM OpenAI-compatible server or a pool of them.

    engine = VllmEngine(arch, VllmConfig(dtype="float32"), run_dir="runs/x")
    engine.update_weights(named_tensors, version=0)    # in memory (the `memory` transport's; weight_sync=memory)
    engine.load_weights_from(model_dir, version=0)     # or an HF folder (the `disk` transport's; reload / restart)
                                                       # the first weights start the servers
    groups = engine.generate(prompts, n=8, sampling=SamplingParams(max_tokens=64))
    engine.stats()   # {"vllm/restarts": 0, "vllm/retries": 0, "vllm/bad_responses": 0, ...}
    engine.close()

Servers. `rollout.vllm.num_servers` launched ones or the `urls` given (pool.py): every sync
reaches each of them, and each request goes to the ready one with the least work in flight.

Requests. One `/v1/completions` request per sample (prompt i, sample j), token ids in, token
ids and per-token sampled log-probs out, up to `max_concurrency` in flight from a thread pool;
a server batches them (continuous batching). Request (i, j) carries the seed
`stream_seed(sampling.seed, i, j)`, the same derivation the embedded engine uses, so a sample
depends on (weights, prompt, seed, i, j) only: not on batching, concurrency, retries or which
server ran it. (The two engines draw different numbers from their streams, so their samples differ.)

Failures, per generate() call. Results are kept by (i, j) as they arrive; a key is stored once
and the call returns only when every key has a validated sample.
- bad answer (malformed JSON, wrong lengths, missing / non-finite log-probs, inconsistent finish
  reason): counted in `vllm/bad_responses`, retried up to `max_retries` times per sample, then
  VllmBadResponseError.
- HTTP 5xx or a dropped connection while the server stays healthy: retried (`vllm/retries`) with
  exponential backoff, up to `max_retries` per sample. HTTP 4xx: VllmRequestError at once.
- server dead (process gone or /health failing, checked every `health_interval_s` while waiting)
  or hung (a request timed out): the server is stopped and taken out of the pool, its unfinished
  samples are sent again at once (to the other servers; with one server, to it once it is back),
  and it is restarted in the background (`vllm/restarts`): with a disk sync on the newest weight
  folder, after which it serves again; with weight_sync=memory on random weights, and it stays
  out (STALE) until the next update_weights() reaches it (the engine holds no copy of the
  streamed weights to push them at once; the sync waits for a restart in progress, so the next
  one always includes it). More than `max_restarts` restarts within one call (all servers
  together), a server at a URL (never restarted by us), or weight_sync=memory with no other
  server left: the server stays out, and when none is left VllmServerDiedError (the trainer
  checkpoints and stops).
- server dead during a sync: restarted on the new weights (disk: which loads them; memory: the
  transfer has failed, the run stops) when `max_restarts` >= 1 (it bounds each sync too).
- never a restart once `stopping()` is true (the run got SIGTERM or Ctrl-C): VllmServerDiedError.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.model.hf_io import save_hf_config
from megatron_rl.rollout.types import Sample, SamplingParams, check_prompts, stream_seed
from megatron_rl.rollout.vllm.config import VllmConfig
from megatron_rl.rollout.vllm.env import detect_device, ensure_vllm_python
from megatron_rl.rollout.vllm.errors import (
    BadResponse,
    VllmBadResponseError,
    VllmError,
    VllmParityError,
    VllmRequestError,
    VllmServerDiedError,
    VllmStartError,
    VllmUnsupportedError,
)
from megatron_rl.rollout.vllm.http import HttpStatusError, TransportError, request_json
from megatron_rl.rollout.vllm.launcher import ENV_API_KEY, HOST, LocalServer, RemoteServer, ServerHandle
from megatron_rl.rollout.vllm.pool import DOWN, FAILED, READY, STALE, Replica, ServerPool
from megatron_rl.rollout.vllm.probe import (
    Reference,
    StreamedReference,
    hf_reference,
    probe_diff,
    probe_tokens,
)
from megatron_rl.rollout.vllm.protocol import (
    check_served,
    completion_body,
    decode_routed_experts,
    parse_completion,
)
from megatron_rl.rollout.vllm.transfer import (
    MemorySync,
    backend_for,
    nccl_needs_vllm,
    push_all,
    weight_transfer_args,
)
from megatron_rl.rollout.vllm.weight_sync import DiskReloadSync, RestartSync, WeightDirs, check_supported

log = logging.getLogger("megatron_rl.rollout.vllm")

Key = tuple[int, int]


class _Failed(Exception):
    """A request that failed on `replica` while it ran its start number `epoch`."""

    def __init__(self, error: Exception, replica: Replica, epoch: int):
        super().__init__(str(error))
        self.error, self.replica, self.epoch = error, replica, epoch


class VllmEngine:
    """RolloutEngine backed by vLLM servers (launched here, or `cfg.url` / `cfg.urls`).

    arch: the policy's architecture (vocab size, MoE or not). cfg: VllmConfig; its "auto"
    fields should be resolved by the caller (make_vllm_engine does it): here dtype "auto" lets
    vLLM use the checkpoint's dtype and logprobs_mode "auto" means raw_logprobs.
    run_dir: server logs (`<run_dir>/vllm/server.log`, `server1.log`, ... for a pool). Weights
        arrive by the transport that cfg.weight_sync takes (trainer/transport.py): `memory`
        streams tensors into update_weights (transfer.py); `disk` hands HF folders to
        load_weights_from, of which the engine keeps the newest keep_weight_dirs.
    reference: the parity probe's reference (tokens -> log-probs [len - 1]); None = transformers
        fp32 on the weights' folder.
    server, device: inject a ServerHandle (tests; a list of them for a pool) and its device
        ("cpu" | "cuda" | "unknown").

    Configurations that would give wrong numbers are refused here, before anything starts
    (VllmUnsupportedError): MoE + in-place reload on CPU, routed experts (R3) on CPU. The servers
    start at the first sync, on those weights.

    Cost: per generate() call, one request per sample spread over the servers (pool.py); per
    sync, each server loads the whole model (disk: from the folder, all at once; memory: the
    bytes once per server worker through the trainer, transfer.push_all) and answers one
    parity probe of `probe_tokens` tokens.
    """

    def __init__(self, arch: ModelArch, cfg: VllmConfig | None = None, run_dir: str = "runs/vllm", *,
                 reference: Reference | None = None, server: ServerHandle | list[ServerHandle] | None = None,
                 device: str | None = None, stopping: Callable[[], bool] = lambda: False):
        self.arch = arch
        cfg = cfg or VllmConfig()
        # with CUDA the trainer drives vLLM's own nccl engine: refused before anything starts
        self.backend = backend_for(torch.cuda.is_available()) if cfg.weight_sync == "memory" else None
        if self.backend is not None and self.backend.name == "nccl" and importlib.util.find_spec("vllm") is None:
            raise VllmUnsupportedError(nccl_needs_vllm())
        # The trainer's stop flag. A server that dies once the run is stopping is not restarted:
        # SLURM signals every process of a job step, this server too, and a restart (a model
        # load) would outlast the grace period before SIGKILL that the trainer needs to save.
        self.stopping = stopping
        self.cfg = cfg
        self.root = os.path.join(run_dir, "vllm")
        self.logprobs_mode = "raw_logprobs" if cfg.logprobs_mode == "auto" else cfg.logprobs_mode
        self.max_model_len = cfg.max_model_len or arch.max_position_embeddings
        self.max_logprobs = cfg.max_logprobs or min(arch.vocab_size, 64)
        self.policy_version = -1
        self.reference = reference
        servers = [server] if server is not None and not isinstance(server, list) else server
        if servers is None:
            servers, device = self._servers(device)
        self.device = device or (cfg.device if cfg.device != "auto" else "unknown")
        for s in servers:
            check_supported(arch, cfg.weight_sync, self.device, cfg.enable_return_routed_experts, s.can_restart)
        self.sync = RestartSync() if cfg.weight_sync == "restart" else DiskReloadSync()
        self.pool = ServerPool([Replica(k, s, MemorySync(s, self.backend, cfg.bucket_bytes, cfg.transfer_host)
                                        if self.backend else None) for k, s in enumerate(servers)])
        self.dirs = WeightDirs(cfg.keep_weight_dirs)  # the folders it was given: a restart starts on the newest
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="vllm-request")
        self._restarter = ThreadPoolExecutor(len(servers), thread_name_prefix="vllm-restart")
        self._restarting: list[Future] = []
        self._lock = threading.Lock()  # the counters and restart decisions, shared with the request threads
        self._call_restarts = 0
        self._started = self._closed = False
        self._syncs = 0
        self._stats: dict[str, float] = {"vllm/restarts": 0, "vllm/retries": 0, "vllm/bad_responses": 0,
                                         "vllm/requests": 0, "vllm/weight_syncs": 0}

    def _servers(self, device: str | None) -> tuple[list[ServerHandle], str | None]:
        """The servers of cfg: one RemoteServer per URL, else num_servers LocalServers."""
        cfg = self.cfg
        if cfg.server_urls:
            key = cfg.api_key or os.environ.get(ENV_API_KEY) or None
            return ([RemoteServer(u, cfg.health_timeout_s, api_key=key) for u in cfg.server_urls],
                    device or (cfg.device if cfg.device != "auto" else "unknown"))
        device = device or (cfg.device if cfg.device != "auto" else None)
        if device is not None:  # refuse before looking for (or installing) the environment
            check_supported(self.arch, cfg.weight_sync, device, cfg.enable_return_routed_experts, True)
        python = ensure_vllm_python(cfg.python)
        device = device or detect_device(python)
        args = self._server_args()
        return [LocalServer(python, args, self._server_env(device, k),
                            os.path.join(self.root, "server.log" if k == 0 else f"server{k}.log"),
                            cfg.startup_timeout_s, cfg.health_timeout_s) for k in range(cfg.num_servers)], device

    @property
    def max_len(self) -> int:
        return self.max_model_len

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    @property
    def server(self) -> ServerHandle:
        """The first server (the only one without a pool)."""
        return self.pool.replicas[0].server

    # ---- server set-up ------------------------------------------------------------------------
    def _server_args(self) -> list[str]:
        c = self.cfg
        args = ["--dtype", c.dtype, "--max-model-len", str(self.max_model_len), "--seed", str(c.seed),
                "--logprobs-mode", self.logprobs_mode, "--max-logprobs", str(self.max_logprobs),
                "--tensor-parallel-size", str(c.tensor_parallel_size), "--skip-tokenizer-init"]
        if c.max_num_seqs:
            args += ["--max-num-seqs", str(c.max_num_seqs)]
        if c.enforce_eager:
            args.append("--enforce-eager")
        if c.quantization:
            args += ["--quantization", c.quantization]
        if c.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        if c.enable_return_routed_experts:
            args.append("--enable-return-routed-experts")
        if self.backend is not None:  # started on random weights; every sync streams them in
            args += ["--load-format", "dummy", *weight_transfer_args(self.backend)]
        return args + list(c.extra_args)

    def _server_env(self, device: str, k: int = 0) -> dict[str, str]:
        # the development endpoints (/collective_rpc, the weight-transfer ones) only where a sync uses them
        dev = self.cfg.weight_sync in ("reload", "memory")
        env = {"VLLM_HOST_IP": HOST, "VLLM_SERVER_DEV_MODE": "1" if dev else "0"}
        if device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.kv_cache_space_gb)
        env.update(self.cfg.env)
        if device == "cuda" and self.cfg.num_servers > 1:
            env["CUDA_VISIBLE_DEVICES"] = server_devices(env.get("CUDA_VISIBLE_DEVICES")
                                                         or os.environ.get("CUDA_VISIBLE_DEVICES"),
                                                         k, self.cfg.tensor_parallel_size, self.cfg.num_servers)
        return env

    def _start(self, model_dir: str) -> None:
        """Start every server on `model_dir` at once; each is READY when it answers."""
        def start(replica: Replica) -> None:
            seconds = replica.server.start(model_dir)
            self._stats["timing/vllm_server_start"] = seconds
            log.info("vLLM %s up in %.1f s", replica.name(), seconds)
            replica.epoch += 1
            self._warmup(replica)
            if replica.memory is not None:
                replica.memory.open(self.cfg.startup_timeout_s)
            if self.cfg.enable_return_routed_experts:
                self._check_routing(replica)
            self.pool.set_state(replica, READY)

        with ThreadPoolExecutor(len(self.replicas)) as pool:
            for f in [pool.submit(start, r) for r in self.replicas]:
                f.result()
        self._started = True

    def _restart(self, replica: Replica, model_dir: str, reason: str) -> None:
        """Stop `replica` and start it anew on `model_dir` (READY for a disk sync; STALE, on random
        weights, for weight_sync=memory). Raises VllmServerDiedError when we may not."""
        server = replica.server
        if not server.can_restart:
            raise VllmServerDiedError(f"vLLM server at {server.url} failed ({reason}) and cannot be restarted by us")
        if self.stopping():
            raise VllmServerDiedError(f"vLLM server at {server.url} failed ({reason}); not restarted: the "
                                      f"run is stopping")
        log.warning("restarting vLLM %s (%s) on %s", replica.name(), reason, model_dir)
        t0 = time.perf_counter()
        server.stop(graceful=False)
        server.restart(model_dir)
        replica.epoch += 1
        self._warmup(replica)
        if replica.memory is not None:
            replica.memory.open(self.cfg.startup_timeout_s)
        with self._lock:
            self._stats["vllm/restarts"] += 1
            replica.restarts += 1
            self._stats["timing/vllm_restart"] = time.perf_counter() - t0
        self.pool.set_state(replica, STALE if replica.memory is not None else READY)
        log.warning("vLLM %s restarted in %.1f s", replica.name(), time.perf_counter() - t0)

    def _warmup(self, replica: Replica) -> None:
        """One short sampled request with log-probs: vLLM compiles an op on the first one, and a
        server that is healthy but cannot run the model (e.g. a kernel the CPU lacks) fails here."""
        if not self.cfg.warmup:
            return
        server = replica.server
        body = completion_body(server.model_name, [0, 1], SamplingParams(max_tokens=2), seed=0)
        try:
            request_json(server.url + "/v1/completions", body, timeout=self.cfg.startup_timeout_s,
                         api_key=server.api_key)
        except (TransportError, HttpStatusError, BadResponse) as e:
            tail = server.log_tail(400)
            hint = ""
            if "died unexpectedly" in tail:
                hint = (f" A vLLM worker process died running the model in {self.cfg.dtype}; on CPU machines "
                        f"without working bf16 kernels bfloat16 dies this way (SIGILL): try "
                        f"rollout.vllm.dtype=float16 or float32.")
            server.stop(graceful=False)
            raise VllmStartError(f"the vLLM server started but failed its first request ({e}).{hint} Log "
                                 f"{server.log_where}, last lines:\n" + "\n".join(tail.splitlines()[-25:])) from e

    def _check_routing(self, replica: Replica) -> None:
        server = replica.server
        body = completion_body(server.model_name, [0, 1], SamplingParams(max_tokens=2), seed=0)
        out = request_json(server.url + "/v1/completions", body, timeout=self.cfg.request_timeout_s,
                           api_key=server.api_key)
        if not (isinstance(out, dict) and out.get("choices") and out["choices"][0].get("routed_experts")):
            self.close()
            raise VllmUnsupportedError(f"router replay R3 was requested but the vLLM server at {server.url} "
                                       f"returns no routed_experts (start it with --enable-return-routed-experts)")

    # ---- weights ------------------------------------------------------------------------------
    def update_weights(self, named_tensors, version: int) -> None:
        """Stream HF checkpoint-format (name, tensor) pairs into every server (weight_sync=memory,
        transfer.py; the first call starts them on random weights; a server restarted since the
        last sync (STALE) is included, and READY after it), probe parity on each against the
        same stream, then set policy_version. Raises VllmParityError when a probe differs by more
        than the tolerance, VllmServerDiedError when the transfer fails (the servers are left
        paused and half updated: the run stops)."""
        if self.backend is None:
            raise VllmError(f"rollout.vllm.weight_sync={self.cfg.weight_sync} takes HF folders (load_weights_from, the "
                            f"disk transport), not tensors in memory")
        t0 = time.perf_counter()
        if not self._started:
            self._start(self._config_dir())
        self._await_restarts()
        for r in self.replicas:
            if r.state == FAILED and r.server.can_restart and not self.stopping():
                try:  # out since a restart failed or the restart budget ran out: on random weights, joins this push
                    self._restart(r, self._config_dir(), r.why)
                except (VllmError, OSError) as e:
                    log.warning("vLLM %s stays out of the pool: %s", r.name(), e)
        targets = [r for r in self.replicas if r.state in (READY, STALE)]
        if not targets:
            raise VllmServerDiedError("no vLLM server of the pool is up for the in-memory weight sync: " + "; ".join(
                f"{r.name()} {r.state}: {r.why}" for r in self.replicas))
        probed = self._probes_next()
        streamed = StreamedReference(self.arch) if probed and self.reference is None else None
        named = streamed.tee(named_tensors) if streamed is not None else named_tensors
        try:
            self._stats["timing/vllm_memory_sync"] = push_all([r.memory for r in targets], named, version,
                                                              self.cfg.request_timeout_s)
        except (TransportError, HttpStatusError, RuntimeError) as e:
            raise VllmServerDiedError(f"in-memory weight sync of version {version} to "
                                      f"{', '.join(r.server.url for r in targets)} failed ({type(e).__name__}: {e}); "
                                      f"the servers' weights are half updated. Logs: "
                                      f"{', '.join(r.server.log_where for r in targets)}") from e
        for r in targets:
            self.pool.set_state(r, READY)
        self._synced(version, f"the in-memory sync of version {version}",
                     streamed.reference if streamed is not None else self.reference, probed, t0)

    def _config_dir(self) -> str:
        """A folder with the model's config.json alone: what a server starts on before weights."""
        path = os.path.join(self.root, "model-config")
        dtype = self.cfg.dtype if self.cfg.dtype != "auto" else "float32"
        save_hf_config(path, self.arch, getattr(torch, dtype))
        return path

    def load_weights_from(self, model_dir: str, version: int) -> None:
        """Make every server serve the HF folder `model_dir` (start them on the first one; then
        reload in place or restart, rollout.vllm.weight_sync, all at once; a server that is down
        is restarted on it), probe parity on each against the reference, then set
        policy_version. The engine owns the folder from now on. Raises VllmParityError when a
        probe differs by more than the tolerance; VllmServerDiedError when no server took it."""
        if self.backend is not None:
            raise VllmError("rollout.vllm.weight_sync=memory takes tensors in memory (update_weights, the memory "
                            "transport), not folders")
        t0 = time.perf_counter()
        self.dirs.add(model_dir)
        if not self._started:
            self._start(model_dir)
        else:
            self._await_restarts()
            with ThreadPoolExecutor(len(self.replicas)) as pool:
                outcomes = [(r, pool.submit(self._load_on, r, model_dir)) for r in self.replicas]
            errors = []
            for r, f in outcomes:
                if f.exception() is not None:
                    self.pool.set_state(r, FAILED, str(f.exception()))
                    errors.append(f.exception())
            if len(errors) == len(self.replicas):
                raise errors[0]
            for e in errors:
                log.warning("a vLLM server is left out of the pool: %s", e)
        self._synced(version, f"the weight sync to {model_dir}", self.reference or hf_reference(model_dir),
                     self._probes_next(), t0)
        self.dirs.prune()

    def _load_on(self, replica: Replica, model_dir: str) -> None:
        if replica.state != READY:  # down since the last sync: a start on the new folder loads it
            return self._sync_failed(replica, model_dir, replica.why or replica.state)
        try:
            timings = self.sync.apply(replica.server, model_dir, self.cfg.request_timeout_s,
                                      lambda: self._warmup(replica))
        except (TransportError, HttpStatusError) as e:
            return self._sync_failed(replica, model_dir, e)
        if "timing/vllm_restart" in timings:  # RestartSync: a new process
            replica.epoch += 1
        with self._lock:
            self._stats.update(timings)
        return None

    def _probes_next(self) -> bool:
        """Whether the parity probe runs after the next sync (every probe_every-th, the first too)."""
        return bool(self.cfg.probe_every) and self._syncs % self.cfg.probe_every == 0

    def _synced(self, version: int, what: str, reference: Reference, probe: bool, t0: float) -> None:
        self._syncs += 1
        self._stats["vllm/weight_syncs"] = self._syncs
        if probe:
            self._stats["vllm/probe_max_abs_diff"] = max(self._probe(r, what, reference) for r in self.pool.ready())
        self.policy_version = version
        self._stats["timing/vllm_weight_sync"] = time.perf_counter() - t0

    def _sync_failed(self, replica: Replica, model_dir: str, e: Exception | str) -> None:
        """A server that failed at (or was down before) a weight sync: one restart, which loads
        `model_dir` as a fresh start does, when max_restarts allows one (it bounds the restarts of
        a load_weights_from() call as it does those of a generate() call)."""
        server = replica.server
        if not server.can_restart or (replica.state == READY and server.alive()):
            raise VllmServerDiedError(f"weight sync to {model_dir} failed: {e}")
        if self.cfg.max_restarts < 1:
            raise VllmServerDiedError(f"the vLLM server died during the weight sync to {model_dir} ({e}) and "
                                      f"rollout.vllm.max_restarts=0 allows no restart. Log: {server.log_where}")
        self._restart(replica, model_dir, f"died during the weight sync: {e}")

    def _probe(self, replica: Replica, what: str, reference: Reference) -> float:
        """The parity probe on one server (one prompt_logprobs request: cheap enough for each)."""
        tokens = probe_tokens(self.arch.vocab_size, min(self.cfg.probe_tokens, self.max_model_len - 1))
        server = replica.server
        diff = probe_diff(server.url, server.model_name, tokens, reference, self.cfg.request_timeout_s,
                          api_key=server.api_key)
        replica.extra["probe_max_abs_diff"] = diff
        tol = self.cfg.tolerance(self.cfg.dtype)
        if not diff <= tol:
            raise VllmParityError(f"after {what} the vLLM server at {server.url}'s log-probs differ from the "
                                  f"reference by {diff:.3g} > {tol:g} (rollout.vllm.probe_tolerance): the server "
                                  f"is not running the exported weights", diff)
        return diff

    def _await_restarts(self) -> None:
        """Wait for the background restarts (a sync must reach a server that is coming back)."""
        for f in self._restarting:
            f.result()
        self._restarting = [f for f in self._restarting if not f.done()]

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Sample]]:
        """n samples per prompt; result[i][j] is sample j of prompt i (see the module docstring)."""
        self._check_args(prompts, n, sampling)
        check_served(self.logprobs_mode, sampling, self.arch.vocab_size)
        keys = [(i, j) for i in range(len(prompts)) for j in range(n)]
        done: dict[Key, Sample] = {}
        tries = dict.fromkeys(keys, 0)
        backoff = self.cfg.retry_backoff_s
        bad_before = self._stats["vllm/bad_responses"]
        self._call_restarts = 0
        t0, tokens0 = time.perf_counter(), [r.tokens for r in self.replicas]
        while len(done) < len(keys):
            pending = [k for k in keys if k not in done]
            ok, failed = self._round(pending, prompts, sampling)
            for k, s in ok.items():
                if k in done:
                    raise AssertionError(f"sample {k} arrived twice")
                done[k] = s
            if len(done) < len(keys):
                self._stats["vllm/retries"] += len(keys) - len(done)
            self._count_failures(failed, tries, bad_before)
            if failed:
                time.sleep(backoff)
                backoff *= 2
        seconds = time.perf_counter() - t0
        for r, before in zip(self.replicas, tokens0):
            r.extra["tokens_per_s"] = (r.tokens - before) / seconds
        return [[done[(i, j)] for j in range(n)] for i in range(len(prompts))]

    def _count_failures(self, failed: dict[Key, Exception], tries: dict[Key, int], bad_before: float) -> None:
        for k, e in failed.items():
            if isinstance(e, HttpStatusError) and e.status < 500:
                raise VllmRequestError(f"the vLLM server refused sample {k}: {e}", e.status)
            if isinstance(e, BadResponse):
                self._stats["vllm/bad_responses"] += 1
            tries[k] += 1
        over = [k for k in failed if tries[k] > self.cfg.max_retries]
        if over:
            bad = [k for k in over if isinstance(failed[k], BadResponse)]
            reasons = [f"{k}: {failed[k]}" for k in over[:3]]
            if bad:
                count = int(self._stats["vllm/bad_responses"] - bad_before)
                raise VllmBadResponseError(
                    f"{len(over)} samples still got invalid answers after {self.cfg.max_retries} retries "
                    f"({count} bad answers in this call); e.g. {reasons}", count=count, examples=reasons)
            raise VllmServerDiedError(f"{len(over)} samples kept failing after {self.cfg.max_retries} retries: "
                                      f"{reasons}")

    def _round(self, keys: list[Key], prompts, sampling: SamplingParams):
        """Send `keys` once. -> (samples by key, failures by key to retry after a backoff). A
        request lost with its server is sent again at once (placed on a server that is READY);
        the server is taken out and restarted (`_lose`)."""
        def send(key: Key) -> Future:
            self._stats["vllm/requests"] += 1
            return self._pool.submit(self._one, prompts[key[0]], key[0], key[1], sampling)

        futures: dict[Future, Key] = {send(k): k for k in keys}
        ok: dict[Key, Sample] = {}
        failed: dict[Key, Exception] = {}
        last_check = time.monotonic()
        try:
            while futures:
                finished, _ = wait(list(futures), timeout=self.cfg.health_interval_s, return_when=FIRST_COMPLETED)
                for f in finished:
                    key = futures.pop(f)
                    e = f.exception()
                    if e is None:
                        ok[key] = f.result()
                        continue
                    if not isinstance(e, _Failed):
                        raise e
                    if isinstance(e.error, TransportError) and self._lost(e.replica, e.epoch, e.error):
                        self._stats["vllm/retries"] += 1
                        futures[send(key)] = key
                    else:
                        failed[key] = e.error
                if futures and time.monotonic() - last_check >= self.cfg.health_interval_s:
                    last_check = time.monotonic()
                    for r in self.pool.ready():
                        if r.in_flight and not r.server.alive():
                            self._lose(r, r.epoch, "server not alive (process gone or /health not answering)")
        finally:
            for f in futures:  # only after a fatal error: the rest are not waited for
                f.cancel()
        return ok, failed

    def _lost(self, replica: Replica, epoch: int, e: TransportError) -> bool:
        """Whether a dropped request went down with its server (-> resend; the server is taken
        out) rather than being a one-off (-> retry after a backoff)."""
        if epoch != replica.epoch or replica.state != READY:
            return True  # in flight when that server went down: already handled
        if e.timed_out:
            reason = f"a request timed out after {self.cfg.request_timeout_s:g} s (server hung?)"
        elif not replica.server.alive():
            reason = f"server died ({e})"
        else:
            return False
        self._lose(replica, epoch, reason)
        return True

    def _lose(self, replica: Replica, epoch: int, reason: str) -> None:
        """Take a dead or hung server out of the pool, stop it (its other requests fail fast and
        are resent) and restart it in the background. Raises VllmServerDiedError when it may not
        come back and no other server is READY."""
        with self._lock:
            if epoch != replica.epoch or replica.state != READY:
                return
            others = [r for r in self.replicas if r is not replica and r.state == READY]
            why = self._no_restart(replica, reason, bool(others))
            self.pool.set_state(replica, FAILED if why else DOWN, why or reason)
            if not why:
                self._call_restarts += 1
        log.warning("vLLM %s taken out of the pool: %s", replica.name(), reason)
        if replica.server.can_restart:
            replica.server.stop(graceful=False)
        if why:
            if not others:
                raise VllmServerDiedError(why)
            log.warning("vLLM %s stays out: %s", replica.name(), why)
            return
        self._restarting.append(self._restarter.submit(self._restart_in_background, replica, reason))

    def _no_restart(self, replica: Replica, reason: str, others: bool) -> str | None:
        """Why `replica` is not restarted (None: it is)."""
        server = replica.server
        if not server.can_restart:
            return f"vLLM server at {server.url} failed ({reason}) and cannot be restarted by us"
        if self.stopping():
            return f"vLLM server at {server.url} failed ({reason}); not restarted: the run is stopping"
        if self._call_restarts >= self.cfg.max_restarts:
            return (f"the vLLM server failed again ({reason}) after {self._call_restarts} restarts in this "
                    f"generate() call (rollout.vllm.max_restarts). Log: {server.log_where}")
        if replica.memory is not None and not others:
            return (f"vLLM server at {server.url} failed ({reason}); with rollout.vllm.weight_sync=memory it is not "
                    f"restarted: the engine holds no copy of the weights to start it on, and no other server of the "
                    f"pool has them (resume the run, use rollout.vllm.num_servers > 1, or weight_sync=reload for "
                    f"restarts from the newest weight folder). Log: {server.log_where}")
        return None

    def _restart_in_background(self, replica: Replica, reason: str) -> None:
        try:
            self._restart(replica, self.dirs.latest or self._config_dir(), reason)
        except Exception as e:  # noqa: BLE001 - the server stays out; the pool fails when none is left
            if not self._closed:  # else close() stopped it under the restart
                log.error("vLLM %s could not be restarted: %s", replica.name(), e)
            self.pool.set_state(replica, FAILED, f"restart failed: {e}")
        if self._closed:  # closed while it started: stop what the restart left running
            replica.server.stop(graceful=False)

    def _one(self, prompt: list[int], i: int, j: int, sampling: SamplingParams) -> Sample:
        num_logprobs = self.max_logprobs if sampling.return_kept_ids else 0
        with self.pool.serving(len(prompt) + sampling.max_tokens, self.cfg.startup_timeout_s) as replica:
            epoch, server = replica.epoch, replica.server
            body = completion_body(server.model_name, prompt, sampling, stream_seed(sampling.seed, i, j), num_logprobs)
            try:
                resp = request_json(server.url + "/v1/completions", body, timeout=self.cfg.request_timeout_s,
                                    api_key=server.api_key)
                ids, logprobs, finish, kept, routed = parse_completion(
                    resp, len(prompt), sampling, self.arch.vocab_size, self.max_model_len, num_logprobs)
            except (TransportError, HttpStatusError, BadResponse) as e:
                raise _Failed(e, replica, epoch) from e
        self.pool.add_tokens(replica, len(ids))
        routed_experts = None
        if self.cfg.enable_return_routed_experts:
            routed_experts = decode_routed_experts(routed, len(prompt) + len(ids) - 1, self.arch.moe_topk)
        return Sample(prompt_ids=torch.tensor(prompt, dtype=torch.long), response_ids=ids, rollout_logprobs=logprobs,
                      finish_reason=finish, policy_version=self.policy_version, prompt_index=i, sample_index=j,
                      routed_experts=routed_experts, kept_ids=kept)

    def _check_args(self, prompts, n: int, sampling: SamplingParams) -> None:
        if not self._started:
            raise VllmError("the vLLM engine has no weights yet: call load_weights_from() first (the server starts "
                            "on the first weights it is given)")
        check_prompts(prompts, n, self.arch.vocab_size)
        for i, p in enumerate(prompts):
            if len(p) + sampling.max_tokens > self.max_model_len:
                raise ValueError(f"prompt {i} ({len(p)} tokens) + max_tokens={sampling.max_tokens} exceeds "
                                 f"max_model_len={self.max_model_len} (rollout.vllm.max_model_len)")
        if sampling.return_kept_ids and self.max_logprobs < 1:
            raise VllmUnsupportedError("return_kept_ids needs rollout.vllm.max_logprobs >= 1")

    # ---- bookkeeping --------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Counters since construction (vllm/restarts, vllm/retries, vllm/bad_responses,
        vllm/requests, vllm/weight_syncs: pool totals) and the last values of
        vllm/probe_max_abs_diff (the largest over the servers) and
        timing/vllm_{server_start,restart,reload,memory_sync,weight_sync} (seconds); for a pool,
        per server k: vllm/server{k}/{requests,tokens,restarts,ready,tokens_per_s (last call),
        probe_max_abs_diff}."""
        return {**self._stats, **self.pool.stats()}

    def close(self) -> None:
        """Stop the servers (if ours), the request threads, and delete the weight folders it was given."""
        self._closed = True
        for r in self.replicas:
            if r.memory is not None:
                r.memory.close()
            r.server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._restarter.shutdown(wait=False, cancel_futures=True)
        self.dirs.clear()
        self._started = False


def server_devices(visible: str | None, k: int, per_server: int, servers: int) -> str:
    """CUDA_VISIBLE_DEVICES of launched server k: the k-th run of `per_server` devices of
    `visible` (the devices given, "0,1,..."; None = 0..servers * per_server - 1)."""
    devices = visible.split(",") if visible else [str(d) for d in range(servers * per_server)]
    if len(devices) < servers * per_server:
        raise VllmUnsupportedError(f"rollout.vllm.num_servers={servers} x tensor_parallel_size={per_server} needs "
                                   f"{servers * per_server} GPUs, CUDA_VISIBLE_DEVICES gives {len(devices)} "
                                   f"({visible}); lower num_servers, or connect to servers on other nodes "
                                   f"(rollout.vllm.urls)")
    return ",".join(devices[k * per_server:(k + 1) * per_server])
