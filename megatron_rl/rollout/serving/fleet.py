"""Keeping an engine's servers up (any kind: its dialect; vLLM's VllmEngine): the first start, the
checks after a start, taking a failed server out of the pool and restarting it, and the engine's
counters (named `vllm/...` whatever the kind).

    fleet = Fleet(arch, cfg, root, pool, stopping, dialect)
    fleet.start(model_dir)                      # every server at once; READY when it answers
    fleet.lose(replica, epoch, "server died")   # out of the pool, restarted in the background
    fleet.await_restarts()                      # a sync must reach a server that is coming back
    fleet.close()

Restarts. A server found dead or hung while requests run (generation.py), or before or during an
in-memory sync (updates.py), is taken out of the pool and stopped (its other requests fail fast and are resent), and restarted in the background
(`vllm/restarts`): with a disk sync on the newest weight folder (`dirs`), after which it serves
again; with weight_sync=memory on random weights, and it stays out (STALE) until the next
update_weights() reaches it (the engine holds no copy of the streamed weights to push them at
once; the sync waits for a restart in progress, so the next one always includes it). More than
`max_restarts` restarts while requests run without a break (one generate() call, or a rollout's
requests; all servers together), a server at a URL
(never restarted by us), or weight_sync=memory with no other server left: the server stays
out, and when none is left ServerDiedError (the trainer checkpoints and stops). Never a
restart once `stopping()` is true (the run got SIGTERM or Ctrl-C): ServerDiedError. The settings
come as ServingConfig (config.py); a message names them in the engine's section (`cfg.section`).

The fleet holds the engine's request loop (loop.py RequestLoop): the warm-up and the routing check
after a start are requests on it, as are generation.py's and updates.py's; a thread that needs one
waits for its answer.

Cost: a start or restart is a model load on that server (~50 s for a tiny model on a 2-core
CPU), plus one warm-up request of 2 tokens; the background restarts use one thread per server.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.model.hf_io import save_hf_config
from megatron_rl.rollout.serving.config import ServingConfig
from megatron_rl.rollout.serving.dialect import Dialect
from megatron_rl.rollout.serving.errors import (
    ServerDiedError,
    ServerStartError,
    UnsupportedError,
)
from megatron_rl.rollout.serving.http import BadResponse, HttpStatusError, TransportError
from megatron_rl.rollout.serving.loop import RequestLoop
from megatron_rl.rollout.serving.pool import DOWN, FAILED, READY, STALE, Replica, ServerPool
from megatron_rl.rollout.serving.receivers import WeightDirs
from megatron_rl.rollout.types import SamplingParams

log = logging.getLogger("megatron_rl.rollout.serving")


class Fleet:
    """The pool's servers and what keeps them up (module docstring); also the engine's counters
    (`stats`, guarded by `lock` with the restart decisions, shared with the engine's request loop)."""

    def __init__(self, arch: ModelArch, cfg: ServingConfig, root: str, pool: ServerPool,
                 stopping: Callable[[], bool], dialect: Dialect):
        self.arch, self.cfg, self.root, self.pool = arch, cfg, root, pool
        self.dialect = dialect  # the servers' kind: the warm-up request's body and path
        # the engine's request loop and HTTP session (loop.py): the warm-up and routing checks here,
        # generation.py's requests and control calls, updates.py's labels and probes
        self.requests = RequestLoop("serving-requests")
        # The trainer's stop flag. A server that dies once the run is stopping is not restarted:
        # SLURM signals every process of a job step, this server too, and a restart (a model
        # load) would outlast the grace period before SIGKILL that the trainer needs to save.
        self.stopping = stopping
        self.dirs = WeightDirs(cfg.keep_weight_dirs)  # the folders it was given: a restart starts on the newest
        self.lock = threading.Lock()
        self.stats: dict[str, float] = {"vllm/restarts": 0, "vllm/retries": 0, "vllm/bad_responses": 0,
                                        "vllm/requests": 0, "vllm/weight_syncs": 0}
        self.call_restarts = 0  # restarts since requests last started after a break (generation.py)
        self.started = self.closed = False
        self.paused: set[int] = set()  # the servers (index) whose requests are frozen for a weight update (generation.py)
        self._restarter = ThreadPoolExecutor(len(pool), thread_name_prefix="serving-restart")
        self._restarting: list[Future] = []
        # take-outs between marking a server DOWN and queueing its restart: the health check's runs
        # beside the calls, so a call can return (its requests resent elsewhere) before it is queued
        self._taking_out = 0
        self._taken_out = threading.Condition(self.lock)

    @property
    def replicas(self) -> list[Replica]:
        return self.pool.replicas

    def start(self, model_dir: str) -> None:
        """Start every server on `model_dir` at once; each is READY when it answers."""
        def start(replica: Replica) -> None:
            seconds = replica.server.start(model_dir)
            self.stats["timing/vllm_server_start"] = seconds
            log.info("%s %s up in %.1f s", self.dialect.name, replica.name(), seconds)
            replica.epoch += 1
            self.warmup(replica)
            if replica.memory is not None:
                replica.memory.open(self.cfg.startup_timeout_s, self.cfg.sync_timeout_s)
            if self.cfg.routed_experts:
                self._check_routing(replica)
            self.pool.set_state(replica, READY)

        with ThreadPoolExecutor(len(self.replicas)) as pool:
            for f in [pool.submit(start, r) for r in self.replicas]:
                f.result()
        self.started = True

    def restart(self, replica: Replica, model_dir: str, reason: str) -> None:
        """Stop `replica` and start it anew on `model_dir` (READY for a disk sync; STALE, on random
        weights, for weight_sync=memory). Raises ServerDiedError when we may not."""
        server = replica.server
        why = self._never_restarted(server, reason)
        if why:
            raise ServerDiedError(why)
        log.warning("restarting %s %s (%s) on %s", self.dialect.name, replica.name(), reason, model_dir)
        t0 = time.perf_counter()
        server.stop(graceful=False)
        server.restart(model_dir)
        replica.epoch += 1
        self.warmup(replica)
        if replica.memory is not None:
            replica.memory.open(self.cfg.startup_timeout_s, self.cfg.sync_timeout_s)
        with self.lock:
            self.stats["vllm/restarts"] += 1
            replica.restarts += 1
            self.stats["timing/vllm_restart"] = time.perf_counter() - t0
        self.pool.set_state(replica, STALE if replica.memory is not None else READY)
        log.warning("%s %s restarted in %.1f s", self.dialect.name, replica.name(), time.perf_counter() - t0)

    def warmup(self, replica: Replica) -> None:
        """One short sampled request with log-probs: a server may compile on the first one (vLLM does),
        and a server that is healthy but cannot run the model (e.g. a kernel the CPU lacks) fails here."""
        if not self.cfg.warmup:
            return
        server = replica.server
        body = self.dialect.generate_body(server.model_name, [0, 1], SamplingParams(max_tokens=2), seed=0)
        try:
            self.requests.call(self.requests.json(server.url + self.dialect.generate_path, body,
                                                  timeout=self.cfg.startup_timeout_s, api_key=server.api_key))
        except (TransportError, HttpStatusError, BadResponse) as e:
            tail = server.log_tail(400)
            hint = ""
            if "died unexpectedly" in tail:
                hint = (f" A {self.dialect.name} worker process died running the model in {self.cfg.dtype}; on CPU "
                        f"machines without working bf16 kernels bfloat16 dies this way (SIGILL): try "
                        f"{self.cfg.section}.dtype=float16 or float32.")
            server.stop(graceful=False)
            raise ServerStartError(f"the {self.dialect.name} server started but failed its first request ({e}).{hint} Log "
                                   f"{server.log_where}, last lines:\n" + "\n".join(tail.splitlines()[-25:])) from e

    def _check_routing(self, replica: Replica) -> None:
        server = replica.server
        sampling = SamplingParams(max_tokens=2)
        body = self.dialect.generate_body(server.model_name, [0, 1], sampling, seed=0)
        cap = self.dialect.answer_cap(2, sampling, routed_values=self.arch.num_layers * self.arch.moe_topk)
        out = self.requests.call(self.requests.json(server.url + self.dialect.generate_path, body,
                                                    timeout=self.cfg.request_timeout_s, api_key=server.api_key,
                                                    max_bytes=cap))
        try:  # the answer as the generate requests read it (the dialect's parse: its routed experts)
            routed, why = self.dialect.parse_generate(out, 2, sampling, self.arch.vocab_size).routed, ""
        except BadResponse as e:
            routed, why = None, f"; its answer: {e}"
        if routed is None:
            self.close()
            raise UnsupportedError(f"router replay R3 was requested but the {self.dialect.name} server at {server.url} "
                                   f"returns no routed_experts (start it with --enable-return-routed-experts)"
                                   f"{why}")

    def config_dir(self) -> str:
        """A folder with the model's config.json alone: what a server starts on before weights."""
        path = os.path.join(self.root, "model-config")
        dtype = self.cfg.dtype if self.cfg.dtype != "auto" else "float32"
        save_hf_config(path, self.arch, getattr(torch, dtype))
        return path

    def await_restarts(self) -> None:
        """Wait for the take-outs under way, then for the background restarts (a sync must reach a
        server that is coming back)."""
        with self.lock:
            self._taken_out.wait_for(lambda: self._taking_out == 0)
            restarting = list(self._restarting)
        for f in restarting:
            f.result()
        with self.lock:
            self._restarting = [f for f in self._restarting if not f.done()]

    def lose(self, replica: Replica, epoch: int, reason: str) -> None:
        """Take a dead or hung server (READY, or STALE: rejoining at a sync) out of the pool, stop
        it (its other requests fail fast and are resent) and restart it in the background. Raises
        ServerDiedError when it may not come back and no other server is READY."""
        with self.lock:
            if epoch != replica.epoch or replica.state not in (READY, STALE):
                return
            others = [r for r in self.replicas if r is not replica and r.state == READY]
            why = self._no_restart(replica, reason, bool(others))
            self.pool.set_state(replica, FAILED if why else DOWN, why or reason)
            if not why:
                self.call_restarts += 1
            self._taking_out += 1
        try:
            log.warning("%s %s taken out of the pool: %s", self.dialect.name, replica.name(), reason)
            if replica.server.can_restart:
                replica.server.stop(graceful=False)
            if why:
                if not others:
                    raise ServerDiedError(why)
                log.warning("%s %s stays out: %s", self.dialect.name, replica.name(), why)
                return
            restart = self._restarter.submit(self._restart_in_background, replica, reason)
            with self.lock:
                self._restarting.append(restart)
        finally:
            with self.lock:
                self._taking_out -= 1
                self._taken_out.notify_all()

    def _no_restart(self, replica: Replica, reason: str, others: bool) -> str | None:
        """Why `replica` is not restarted (None: it is)."""
        server, kind = replica.server, self.dialect.name
        never = self._never_restarted(server, reason)
        if never:
            return never
        if self.call_restarts >= self.cfg.max_restarts:
            return (f"the {kind} server failed again ({reason}) after {self.call_restarts} restarts while "
                    f"requests ran without a break ({self.cfg.section}.max_restarts). Log: {server.log_where}")
        if replica.memory is not None and not others:
            return self._none_left(replica, reason)
        return None

    def _never_restarted(self, server, reason: str) -> str | None:
        """Why `server` may not be restarted at all (a server at a URL, a stopping run); None: it may."""
        if not server.can_restart:
            return f"{self.dialect.name} server at {server.url} failed ({reason}) and cannot be restarted by us"
        if self.stopping():
            return f"{self.dialect.name} server at {server.url} failed ({reason}); not restarted: the run is stopping"
        return None

    def _none_left(self, replica: Replica, reason: str) -> str:
        """Why the last server of an in-memory-synced pool is not restarted, and the ways out."""
        server, kind = replica.server, self.dialect.name
        why = ("the engine holds no copy of the weights to start it on, and no other server of the pool has them: "
               "resume the run from its last checkpoint (train.resume=true), or set rollout.weight_sync=reload "
               "(restarts from the newest weight folder)")
        if len(self.replicas) == 1:
            return (f"{kind} server at {server.url} failed ({reason}); with rollout.weight_sync=memory it is not "
                    f"restarted: {why}, or use {self.cfg.section}.num_servers > 1 so that the others carry on while "
                    f"it restarts. Log: {server.log_where}")
        others = "; ".join(f"{r.name()} {r.state}: {r.why or '-'}" for r in self.replicas if r is not replica)
        return (f"every {kind} server of the pool of {len(self.replicas)} is out: {replica.name()} failed ({reason}), "
                f"and the others cannot serve ({others}). With rollout.weight_sync=memory none is restarted: "
                f"{why}. Logs: {', '.join(r.server.log_where for r in self.replicas)}")

    def _restart_in_background(self, replica: Replica, reason: str) -> None:
        try:
            self.restart(replica, self.dirs.latest or self.config_dir(), reason)
        except Exception as e:  # noqa: BLE001 - the server stays out; the pool fails when none is left
            if not self.closed:  # else close() stopped it under the restart
                log.error("%s %s could not be restarted: %s", self.dialect.name, replica.name(), e)
            self.pool.set_state(replica, FAILED, f"restart failed: {e}")
        if self.closed:  # closed while it started: stop what the restart left running
            replica.server.stop(graceful=False)

    def close(self) -> None:
        """Stop the request loop, the servers (if ours) and their in-memory syncs, and delete the
        weight folders."""
        self.closed = True
        self.requests.close()
        for r in self.replicas:
            if r.memory is not None:
                r.memory.close()
            r.server.stop()
        self._restarter.shutdown(wait=False, cancel_futures=True)
        self.dirs.clear()
        self.started = False
