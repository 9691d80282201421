"""`VllmEngine`: the RolloutEngine contract on a vLLM OpenAI-compatible server.

    engine = VllmEngine(arch, VllmConfig(dtype="float32"), run_dir="runs/x")
    engine.update_weights(named_tensors, version=0)    # in memory (the `memory` transport's; weight_sync=memory)
    engine.load_weights_from(model_dir, version=0)     # or an HF folder (the `disk` transport's; reload / restart)
                                                       # the first weights start the server
    groups = engine.generate(prompts, n=8, sampling=SamplingParams(max_tokens=64))
    engine.stats()   # {"vllm/restarts": 0, "vllm/retries": 0, "vllm/bad_responses": 0, ...}
    engine.close()

Requests. One `/v1/completions` request per sample (prompt i, sample j), token ids in, token
ids and per-token sampled log-probs out, up to `max_concurrency` in flight from a thread pool;
the server batches them (continuous batching). Request (i, j) carries the seed
`stream_seed(sampling.seed, i, j)`, the same derivation the embedded engine uses, so a sample
depends on (weights, prompt, seed, i, j) only: not on batching, concurrency or retries. (The two
engines draw different numbers from their streams, so their samples differ.)

Failures, per generate() call. Results are kept by (i, j) as they arrive; a key is stored once
and the call returns only when every key has a validated sample.
- bad answer (malformed JSON, wrong lengths, missing / non-finite log-probs, inconsistent finish
  reason): counted in `vllm/bad_responses`, retried up to `max_retries` times per sample, then
  VllmBadResponseError.
- HTTP 5xx or a dropped connection while the server stays healthy: retried (`vllm/retries`) with
  exponential backoff, up to `max_retries` per sample. HTTP 4xx: VllmRequestError at once.
- server dead (process gone or /health failing, checked every `health_interval_s` while waiting)
  or hung (a request timed out): the server is stopped, restarted on the latest weights
  (`vllm/restarts`), and the unfinished samples are sent again. After `max_restarts` restarts
  within one call: VllmServerDiedError (the trainer checkpoints and stops).
- server dead during load_weights_from(): restarted on the new weights, which loads them, when
  `max_restarts` >= 1 (it bounds each load_weights_from() call too); else VllmServerDiedError.
- weight_sync=memory: a server that dies is never restarted (VllmServerDiedError): the engine
  holds no copy of the weights it streamed to start a new one on.
- never a restart once `stopping()` is true (the run got SIGTERM or Ctrl-C): VllmServerDiedError.
"""
from __future__ import annotations

import importlib.util
import logging
import os
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
from megatron_rl.rollout.vllm.transfer import MemorySync, backend_for, nccl_needs_vllm, weight_transfer_args
from megatron_rl.rollout.vllm.weight_sync import DiskReloadSync, RestartSync, WeightDirs, check_supported

log = logging.getLogger("megatron_rl.rollout.vllm")

Key = tuple[int, int]


class VllmEngine:
    """RolloutEngine backed by a vLLM server (launched here, or `cfg.url`).

    arch: the policy's architecture (vocab size, MoE or not). cfg: VllmConfig; its "auto"
    fields should be resolved by the caller (make_vllm_engine does it): here dtype "auto" lets
    vLLM use the checkpoint's dtype and logprobs_mode "auto" means raw_logprobs.
    run_dir: server log (`<run_dir>/vllm/server.log`). Weights arrive by the transport that
        cfg.weight_sync takes (trainer/transport.py): `memory` streams tensors into update_weights
        (transfer.py); `disk` hands HF folders to load_weights_from, of which the engine keeps the
        newest keep_weight_dirs.
    reference: the parity probe's reference (tokens -> log-probs [len - 1]); None = transformers
        fp32 on the weights' folder.
    server, device: inject a ServerHandle (tests) and its device ("cpu" | "cuda" | "unknown").

    Configurations that would give wrong numbers are refused here, before anything starts
    (VllmUnsupportedError): MoE + in-place reload on CPU, routed experts (R3) on CPU. The server
    starts at the first load_weights_from(), on those weights.
    """

    def __init__(self, arch: ModelArch, cfg: VllmConfig | None = None, run_dir: str = "runs/vllm", *,
                 reference: Reference | None = None, server: ServerHandle | None = None,
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
        if server is None:
            if cfg.url:
                server = RemoteServer(cfg.url, cfg.health_timeout_s,
                                      api_key=cfg.api_key or os.environ.get(ENV_API_KEY) or None)
                device = device or (cfg.device if cfg.device != "auto" else "unknown")
            else:
                device = device or (cfg.device if cfg.device != "auto" else None)
                if device is not None:  # refuse before looking for (or installing) the environment
                    check_supported(arch, cfg.weight_sync, device, cfg.enable_return_routed_experts, True)
                python = ensure_vllm_python(cfg.python)
                device = device or detect_device(python)
                server = LocalServer(python, self._server_args(), self._server_env(device),
                                     os.path.join(self.root, "server.log"), cfg.startup_timeout_s,
                                     cfg.health_timeout_s)
        self.device = device or (cfg.device if cfg.device != "auto" else "unknown")
        check_supported(arch, cfg.weight_sync, self.device, cfg.enable_return_routed_experts, server.can_restart)
        self.server = server
        self.sync = RestartSync() if cfg.weight_sync == "restart" else DiskReloadSync()
        self.memory = MemorySync(server, self.backend, cfg.bucket_bytes, cfg.transfer_host) if self.backend else None
        self.dirs = WeightDirs(cfg.keep_weight_dirs)  # the folders it was given: a restart starts on the newest
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="vllm-request")
        self._started = False
        self._syncs = 0
        self._stats: dict[str, float] = {"vllm/restarts": 0, "vllm/retries": 0, "vllm/bad_responses": 0,
                                         "vllm/requests": 0, "vllm/weight_syncs": 0}

    @property
    def max_len(self) -> int:
        return self.max_model_len

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

    def _server_env(self, device: str) -> dict[str, str]:
        # the development endpoints (/collective_rpc, the weight-transfer ones) only where a sync uses them
        dev = self.cfg.weight_sync in ("reload", "memory")
        env = {"VLLM_HOST_IP": HOST, "VLLM_SERVER_DEV_MODE": "1" if dev else "0"}
        if device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.cfg.kv_cache_space_gb)
        env.update(self.cfg.env)
        return env

    def _start(self, model_dir: str) -> None:
        seconds = self.server.start(model_dir)
        self._stats["timing/vllm_server_start"] = seconds
        log.info("vLLM server up at %s in %.1f s", self.server.url, seconds)
        self._warmup()
        if self.memory is not None:
            self.memory.open(self.cfg.startup_timeout_s)
        self._started = True
        if self.cfg.enable_return_routed_experts:
            self._check_routing()

    def _restart(self, model_dir: str, reason: str) -> None:
        if not self.server.can_restart:
            raise VllmServerDiedError(f"vLLM server at {self.server.url} failed ({reason}) and cannot be "
                                      f"restarted by us")
        if self.memory is not None:
            raise VllmServerDiedError(f"vLLM server at {self.server.url} failed ({reason}); with "
                                      f"rollout.vllm.weight_sync=memory it is not restarted: the engine holds no "
                                      f"copy of the weights to start it on (resume the run, or use weight_sync=reload "
                                      f"for restarts from the newest weight folder). Log: {self._log_hint()}")
        if self.stopping():
            raise VllmServerDiedError(f"vLLM server at {self.server.url} failed ({reason}); not restarted: the "
                                      f"run is stopping")
        log.warning("restarting the vLLM server (%s) on %s", reason, model_dir)
        t0 = time.perf_counter()
        self.server.stop(graceful=False)
        self.server.restart(model_dir)
        self._warmup()
        self._stats["vllm/restarts"] += 1
        self._stats["timing/vllm_restart"] = time.perf_counter() - t0
        log.warning("vLLM server restarted in %.1f s", self._stats["timing/vllm_restart"])

    def _warmup(self) -> None:
        """One short sampled request with log-probs: vLLM compiles an op on the first one, and a
        server that is healthy but cannot run the model (e.g. a kernel the CPU lacks) fails here."""
        if not self.cfg.warmup:
            return
        body = completion_body(self.server.model_name, [0, 1], SamplingParams(max_tokens=2), seed=0)
        try:
            request_json(self.server.url + "/v1/completions", body, timeout=self.cfg.startup_timeout_s,
                         api_key=self.server.api_key)
        except (TransportError, HttpStatusError, BadResponse) as e:
            tail = self.server.log_tail(400)
            hint = ""
            if "died unexpectedly" in tail:
                hint = (f" A vLLM worker process died running the model in {self.cfg.dtype}; on CPU machines "
                        f"without working bf16 kernels bfloat16 dies this way (SIGILL): try "
                        f"rollout.vllm.dtype=float16 or float32.")
            self.server.stop(graceful=False)
            raise VllmStartError(f"the vLLM server started but failed its first request ({e}).{hint} Log "
                                 f"{self._log_hint()}, last lines:\n" + "\n".join(tail.splitlines()[-25:])) from e

    def _check_routing(self) -> None:
        body = completion_body(self.server.model_name, [0, 1], SamplingParams(max_tokens=2), seed=0)
        out = request_json(self.server.url + "/v1/completions", body, timeout=self.cfg.request_timeout_s,
                           api_key=self.server.api_key)
        if not (isinstance(out, dict) and out.get("choices") and out["choices"][0].get("routed_experts")):
            self.close()
            raise VllmUnsupportedError(f"router replay R3 was requested but the vLLM server at {self.server.url} "
                                       f"returns no routed_experts (start it with --enable-return-routed-experts)")

    # ---- weights ------------------------------------------------------------------------------
    def update_weights(self, named_tensors, version: int) -> None:
        """Stream HF checkpoint-format (name, tensor) pairs into the server (weight_sync=memory,
        transfer.py; the first call starts it on random weights), probe parity against the same
        stream, then set policy_version. Raises VllmParityError when the probe differs by more
        than the tolerance, VllmServerDiedError when the transfer fails (the server is left
        paused and half updated: the run stops)."""
        if self.memory is None:
            raise VllmError(f"rollout.vllm.weight_sync={self.cfg.weight_sync} takes HF folders (load_weights_from, the "
                            f"disk transport), not tensors in memory")
        t0 = time.perf_counter()
        if not self._started:
            self._start(self._config_dir())
        probed = self._probes_next()
        streamed = StreamedReference(self.arch) if probed and self.reference is None else None
        named = streamed.tee(named_tensors) if streamed is not None else named_tensors
        try:
            self._stats["timing/vllm_memory_sync"] = self.memory.push(named, version, self.cfg.request_timeout_s)
        except (TransportError, HttpStatusError, RuntimeError) as e:
            raise VllmServerDiedError(f"in-memory weight sync of version {version} to {self.server.url} failed "
                                      f"({type(e).__name__}: {e}); the server's weights are half updated. Log: "
                                      f"{self._log_hint()}") from e
        self._synced(version, f"the in-memory sync of version {version}",
                     streamed.reference if streamed is not None else self.reference, probed, t0)

    def _config_dir(self) -> str:
        """A folder with the model's config.json alone: what the server starts on before weights."""
        path = os.path.join(self.root, "model-config")
        dtype = self.cfg.dtype if self.cfg.dtype != "auto" else "float32"
        save_hf_config(path, self.arch, getattr(torch, dtype))
        return path

    def load_weights_from(self, model_dir: str, version: int) -> None:
        """Make the server serve the HF folder `model_dir` (start it on the first one; then reload
        in place or restart, rollout.vllm.weight_sync), probe parity against the reference, then set
        policy_version. The engine owns the folder from now on. Raises VllmParityError when the
        probe differs by more than the tolerance."""
        if self.memory is not None:
            raise VllmError("rollout.vllm.weight_sync=memory takes tensors in memory (update_weights, the memory "
                            "transport), not folders")
        t0 = time.perf_counter()
        self.dirs.add(model_dir)
        if not self._started:
            self._start(model_dir)
        else:
            try:
                self._stats.update(self.sync.apply(self.server, model_dir, self.cfg.request_timeout_s, self._warmup))
            except (TransportError, HttpStatusError) as e:
                self._sync_failed(model_dir, e)
        self._synced(version, f"the weight sync to {model_dir}", self.reference or hf_reference(model_dir),
                     self._probes_next(), t0)
        self.dirs.prune()

    def _probes_next(self) -> bool:
        """Whether the parity probe runs after the next sync (every probe_every-th, the first too)."""
        return bool(self.cfg.probe_every) and self._syncs % self.cfg.probe_every == 0

    def _synced(self, version: int, what: str, reference: Reference, probe: bool, t0: float) -> None:
        self._syncs += 1
        self._stats["vllm/weight_syncs"] = self._syncs
        if probe:
            self._probe(what, reference)
        self.policy_version = version
        self._stats["timing/vllm_weight_sync"] = time.perf_counter() - t0

    def _sync_failed(self, model_dir: str, e: Exception) -> None:
        """A weight sync that failed because the server died: one restart, which loads `model_dir`
        as a fresh start does, when max_restarts allows one (it bounds the restarts of an
        load_weights_from() call as it does those of a generate() call)."""
        if not self.server.can_restart or self.server.alive():
            raise VllmServerDiedError(f"weight sync to {model_dir} failed: {e}") from e
        if self.cfg.max_restarts < 1:
            raise VllmServerDiedError(f"the vLLM server died during the weight sync to {model_dir} ({e}) and "
                                      f"rollout.vllm.max_restarts=0 allows no restart. Log: {self._log_hint()}") from e
        self._restart(model_dir, f"died during the weight sync: {e}")

    def _probe(self, what: str, reference: Reference) -> None:
        tokens = probe_tokens(self.arch.vocab_size, min(self.cfg.probe_tokens, self.max_model_len - 1))
        diff = probe_diff(self.server.url, self.server.model_name, tokens, reference, self.cfg.request_timeout_s,
                          api_key=self.server.api_key)
        self._stats["vllm/probe_max_abs_diff"] = diff
        tol = self.cfg.tolerance(self.cfg.dtype)
        if not diff <= tol:
            raise VllmParityError(f"after {what} the vLLM server's log-probs differ from the "
                                  f"reference by {diff:.3g} > {tol:g} (rollout.vllm.probe_tolerance): the server "
                                  f"is not running the exported weights", diff)

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Sample]]:
        """n samples per prompt; result[i][j] is sample j of prompt i (see the module docstring)."""
        self._check_args(prompts, n, sampling)
        check_served(self.logprobs_mode, sampling, self.arch.vocab_size)
        keys = [(i, j) for i in range(len(prompts)) for j in range(n)]
        done: dict[Key, Sample] = {}
        tries = dict.fromkeys(keys, 0)
        restarts, backoff = 0, self.cfg.retry_backoff_s
        bad_before = self._stats["vllm/bad_responses"]
        while len(done) < len(keys):
            pending = [k for k in keys if k not in done]
            ok, failed, down = self._round(pending, prompts, sampling)
            for k, s in ok.items():
                if k in done:
                    raise AssertionError(f"sample {k} arrived twice")
                done[k] = s
            if len(done) < len(keys):
                self._stats["vllm/retries"] += len(keys) - len(done)
            if down is not None:
                if restarts >= self.cfg.max_restarts:
                    raise VllmServerDiedError(
                        f"the vLLM server failed again ({down}) after {restarts} restarts in this generate() call; "
                        f"{len(done)}/{len(keys)} samples were done and are discarded. Log: {self._log_hint()}")
                restarts += 1
                self._restart(self.dirs.latest, down)
                continue
            self._count_failures(failed, tries, bad_before)
            if failed:
                time.sleep(backoff)
                backoff *= 2
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
        """Send `keys` once. -> (samples by key, failures by key, reason the server is down or None).
        Stops a dead/hung local server at once so its other requests fail fast."""
        futures: dict[Future, Key] = {self._pool.submit(self._one, prompts[i], i, j, sampling): (i, j)
                                      for i, j in keys}
        self._stats["vllm/requests"] += len(futures)
        ok: dict[Key, Sample] = {}
        failed: dict[Key, Exception] = {}
        down: str | None = None
        fatal: BaseException | None = None
        remaining = set(futures)
        last_check = time.monotonic()
        while remaining:
            finished, remaining = wait(remaining, timeout=self.cfg.health_interval_s, return_when=FIRST_COMPLETED)
            for f in finished:
                key = futures[f]
                if f.cancelled():
                    continue
                e = f.exception()
                if e is None:
                    ok[key] = f.result()
                elif isinstance(e, (BadResponse, HttpStatusError)):
                    failed[key] = e
                elif isinstance(e, TransportError):
                    if down is None:
                        down = self._diagnose(e)
                    if down is None:
                        failed[key] = e
                else:
                    fatal = fatal or e
            if down is None and remaining and time.monotonic() - last_check >= self.cfg.health_interval_s:
                last_check = time.monotonic()
                if not self.server.alive():
                    down = "server not alive (process gone or /health not answering)"
            if (down is not None or fatal is not None) and remaining:
                for f in remaining:
                    f.cancel()
                if down is not None and self.server.can_restart:
                    self.server.stop(graceful=False)  # in-flight requests now fail fast
                    continue
                if fatal is not None:
                    wait(remaining)
                break  # a server we cannot restart: the caller raises, stragglers time out on their own
        if fatal is not None:
            raise fatal
        return ok, failed, down

    def _diagnose(self, e: TransportError) -> str | None:
        """A dropped request: the server's fault (-> restart) or a one-off (-> retry)?"""
        if e.timed_out:
            return f"a request timed out after {self.cfg.request_timeout_s:g} s (server hung?)"
        if not self.server.alive():
            return f"server died ({e})"
        return None

    def _one(self, prompt: list[int], i: int, j: int, sampling: SamplingParams) -> Sample:
        num_logprobs = self.max_logprobs if sampling.return_kept_ids else 0
        body = completion_body(self.server.model_name, prompt, sampling, stream_seed(sampling.seed, i, j),
                               num_logprobs)
        resp = request_json(self.server.url + "/v1/completions", body, timeout=self.cfg.request_timeout_s,
                            api_key=self.server.api_key)
        ids, logprobs, finish, kept, routed = parse_completion(resp, len(prompt), sampling, self.arch.vocab_size,
                                                               self.max_model_len, num_logprobs)
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
        vllm/requests, vllm/weight_syncs) and the last values of vllm/probe_max_abs_diff and
        timing/vllm_{server_start,restart,reload,memory_sync,weight_sync} (seconds)."""
        return dict(self._stats)

    def _log_hint(self) -> str:
        return self.server.log_where

    def close(self) -> None:
        """Stop the server (if ours), the request threads, and delete the weight folders it was given."""
        if self.memory is not None:
            self.memory.close()
        self.server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.dirs.clear()
        self._started = False
