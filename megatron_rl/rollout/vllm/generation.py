"""One generate() call of a VllmEngine: the requests, their retries, and a weight update in the middle.

    gen = Generation(arch, cfg, fleet, logprobs_mode, max_model_len, max_logprobs)
    samples = gen.generate(requests, version)      # one per rollout/types.py Request, in order
    gen.abort() | gen.pause(); push the weights; gen.resume()       # trainer thread, while it runs

Requests. One vLLM token-in/token-out request (`/inference/v1/generate`, protocol.py) per
`Request` of the call (rollout/types.py; a generate() call's sample j of prompt i is request (i, j)
of `requests_of`), each with its own sampling settings: token ids in; token ids, per-token sampled
log-probs and each token's weight version out; up to `max_concurrency` in flight from a thread
pool; a server batches them (continuous batching). A request with stream (i, j) carries the seed
`stream_seed(sampling.seed, i, j)`, the
same derivation the embedded engine uses, so a sample depends on (weights, prompt, seed, i, j)
only: not on batching, concurrency, retries or which server ran it. (The two engines draw
different numbers from their streams, so their samples differ.)

Failures. Results are kept by request index as they arrive; a key is stored once and the call returns
only when every key has a validated sample.
- bad answer (malformed JSON, wrong lengths, missing / non-finite log-probs, inconsistent finish
  reason, longer than any valid answer to its request: protocol.generate_answer_cap, read no
  further than that): counted in `vllm/bad_responses`, retried up to `max_retries` times per sample, then
  VllmBadResponseError.
- HTTP 5xx or a dropped connection while the server stays healthy: retried (`vllm/retries`) with
  exponential backoff, up to `max_retries` per sample. HTTP 4xx: VllmRequestError at once.
- server dead (process gone or /health failing, checked every `health_interval_s` while waiting)
  or hung (no whole answer within `request_timeout_s`, one deadline from connect to last byte:
  a server that trickles bytes is hung too): the server is taken out and restarted (fleet.py), and its
  unfinished samples are sent again at once (to the other servers; with one server, to it once
  it is back).

Abort (train.in_flight_update=abort). `abort()` ends the call in flight: requests not yet sent
are dropped, each server is asked to end the ones it runs (vLLM's `/abort_requests`, no ids:
all of them; the servers serve this engine alone, whose syncs set their weights), the call
waits until every request thread has returned and raises GenerationAborted (its samples are
lost: the schedule generates them again on the new weights). A server without the development
endpoints (VLLM_SERVER_DEV_MODE=0: weight_sync=restart, or a server at a URL started without
it) answers 404 and its requests run to their end (at most max_tokens each) before abort()
returns: slower, still correct. A call that starts between abort() and resume() waits for
resume().

Pause (train.in_flight_update=pause, partial rollouts). `pause()` freezes every server's running
requests where they are (vLLM's `/pause?mode=keep`; requests that arrive meanwhile queue); the
weights are pushed, each sync labelling the server's weights with the trainer version;
`resume()` drops the KV computed by the old weights (`/reset_prefix_cache?reset_running_requests
=true`: the running requests are preempted, and recomputed from prompt + tokens so far on the
new weights, one prefill each, as the embedded engine does) and lets them go on (`/resume`).
Each answer's weight-version spans (protocol.py) give every token's version: the tokens before
the update carry the old one (Sample.token_versions). The call sees a pause only as slower
requests.

Cost: per call, one request per sample spread over the servers (pool.py); the waits are
event-driven (no polling beyond the health check every health_interval_s); an abort or a pause
costs one small request per server.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.pausing import GenerationAborted
from megatron_rl.rollout.types import Request, Sample, check_requests, stream_seed
from megatron_rl.rollout.vllm.config import VllmConfig
from megatron_rl.rollout.vllm.errors import (
    AnswerTooLarge,
    BadResponse,
    VllmBadResponseError,
    VllmError,
    VllmRequestError,
    VllmServerDiedError,
    VllmUnsupportedError,
)
from megatron_rl.rollout.vllm.fleet import Fleet
from megatron_rl.rollout.vllm.http import HttpStatusError, TransportError, request_json
from megatron_rl.rollout.vllm.pool import READY, Replica
from megatron_rl.rollout.vllm.protocol import (
    GENERATE,
    check_served,
    decode_routed_experts,
    generate_answer_cap,
    generate_body,
    parse_generate,
)

log = logging.getLogger("megatron_rl.rollout.vllm")

Key = int  # a request's index in its call


class _Failed(Exception):
    """A request that failed on `replica` while it ran its start number `epoch`."""

    def __init__(self, error: Exception, replica: Replica, epoch: int):
        super().__init__(str(error))
        self.error, self.replica, self.epoch = error, replica, epoch


class _Dropped(Exception):
    """A request not sent: the call was aborted before its turn."""


class Generation:
    """Sends a call's requests and collects their samples (module docstring)."""

    def __init__(self, arch: ModelArch, cfg: VllmConfig, fleet: Fleet, logprobs_mode: str, max_model_len: int,
                 max_logprobs: int):
        self.arch, self.cfg, self.fleet = arch, cfg, fleet
        self.logprobs_mode, self.max_model_len, self.max_logprobs = logprobs_mode, max_model_len, max_logprobs
        self.stats = fleet.stats
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="vllm-request")
        self._cond = threading.Condition()  # the abort state below, shared with the trainer thread
        self._held = False  # between abort() / pause() and resume(): no call starts
        self._active = False  # a call is running
        self._aborting = threading.Event()  # set by abort(): the running call ends; wakes its waits
        self._wake: Future | None = None  # done when the running call is aborted: wakes its wait()

    # ---- abort (the trainer thread) -------------------------------------------------------------
    def abort(self) -> None:
        """Make the call in flight raise GenerationAborted; return once it has ended (at once when
        none runs). Calls wait for resume() before starting."""
        with self._cond:
            self._held = True
            if not self._active:
                return
            self._aborting.set()
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)
            self._cond.wait_for(lambda: not self._active)

    def pause(self) -> None:
        """Freeze the call in flight on every READY server (module docstring); return once they all
        are (at once when no call runs). Calls wait for resume() before starting. A server that
        does not answer is taken out (its requests go to the others after resume)."""
        with self._cond:
            self._held = True
            active = self._active
        if not active:
            return
        with self.fleet.lock:
            self.stats["vllm/pauses"] = self.stats.get("vllm/pauses", 0) + 1
        for r in self.fleet.pool.ready():
            try:
                # clear_cache=false: the caches are dropped once the new weights are in (resume), not
                # twice (vLLM 0.32 still reads it for mode=keep, though it is documented as ignored)
                request_json(r.server.url + "/pause?mode=keep&clear_cache=false", {},
                             timeout=self.cfg.request_timeout_s, api_key=r.server.api_key)
                self.fleet.paused.add(r.index)
            except HttpStatusError as e:
                self.resume()  # the servers frozen so far go on, and calls may start: the run stops on the error
                raise VllmUnsupportedError(f"vLLM {r.name()} refused to pause ({e}): a pause needs the development "
                                           f"endpoints (VLLM_SERVER_DEV_MODE=1)") from e
            except (TransportError, BadResponse) as e:
                self.fleet.lose(r, r.epoch, f"did not pause for a weight update: {e}")

    def resume(self) -> None:
        """End an abort() or a pause(): frozen requests go on (on the weights pushed meanwhile)."""
        self._resume_servers()
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def _resume_servers(self) -> None:
        paused = [r for r in self.fleet.replicas if r.index in self.fleet.paused]
        self.fleet.paused.clear()
        for r in paused:
            if r.state != READY:  # lost or restarted meanwhile: nothing of it is frozen any more
                continue
            try:
                # The frozen requests' KV (and the prefix cache) came from the old weights: preempting
                # them makes vLLM recompute prompt + tokens so far on the new weights before going on,
                # so every later token is the new policy's given its prefix (as the embedded engine does).
                request_json(r.server.url + "/reset_prefix_cache?reset_running_requests=true", {},
                             timeout=self.cfg.request_timeout_s, api_key=r.server.api_key)
                request_json(r.server.url + "/resume", {}, timeout=self.cfg.request_timeout_s, api_key=r.server.api_key)
            except (TransportError, HttpStatusError, BadResponse) as e:
                self.fleet.lose(r, r.epoch, f"did not resume after a weight update: {e}")

    def _begin(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._held)  # a call never starts during an update
            self._active = True
            self._aborting.clear()
            self._wake = Future()

    def _end(self) -> None:
        with self._cond:
            self._active, self._wake = False, None
            self._cond.notify_all()

    def _abort_servers(self) -> None:
        """Ask every READY server to end the requests it runs (see the module docstring). A request
        that reaches its server after this runs to its end: abort() then waits for it. A paused
        server (an abort after pause(): the weight push failed), whatever its state, has its
        frozen requests ended by /pause?mode=abort and stays paused: resume() does not let it go
        on, since its weights may be half loaded (the pool has marked it out)."""
        frozen = [r for r in self.fleet.replicas if r.index in self.fleet.paused]
        self.fleet.paused.difference_update(r.index for r in frozen)
        for r in frozen + [r for r in self.fleet.pool.ready() if r not in frozen]:
            # clear_cache=false: nothing of the (maybe half loaded) model is touched
            path = "/pause?mode=abort&clear_cache=false" if r in frozen else "/abort_requests"
            try:
                request_json(r.server.url + path, {}, timeout=self.cfg.request_timeout_s, api_key=r.server.api_key)
            except (TransportError, HttpStatusError, BadResponse) as e:
                log.info("vLLM %s did not abort its requests (%s): they run to their end", r.name(), e)

    # ---- the call -------------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request], version: Callable[[], int]) -> list[Sample]:
        """One sample per request, in order, each tagged `version()` (read once the call may start:
        a call held by abort() runs on the weights pushed meanwhile)."""
        self._check_args(requests)
        for sampling in {r.sampling for r in requests}:
            check_served(self.logprobs_mode, sampling, self.arch.vocab_size)
        self._begin()
        try:
            return self._generate(list(requests), version())
        finally:
            self._end()

    def _generate(self, requests: list[Request], policy_version: int) -> list[Sample]:
        keys = list(range(len(requests)))
        done: dict[Key, Sample] = {}
        tries = dict.fromkeys(keys, 0)
        backoff = self.cfg.retry_backoff_s
        bad_before = self.stats["vllm/bad_responses"]
        self.fleet.call_restarts = 0
        replicas = self.fleet.replicas
        t0, tokens0 = time.perf_counter(), [r.tokens for r in replicas]
        while len(done) < len(keys):
            if self._aborting.is_set():
                self._aborted()
            pending = [k for k in keys if k not in done]
            ok, failed = self._round(pending, requests, policy_version)
            for k, s in ok.items():
                if k in done:
                    raise AssertionError(f"sample {k} arrived twice")
                done[k] = s
            if len(done) < len(keys):
                self.stats["vllm/retries"] += len(keys) - len(done)
            self._count_failures(failed, tries, bad_before)
            if failed and self._aborting.wait(backoff):
                self._aborted()
            backoff *= 2 if failed else 1
        seconds = time.perf_counter() - t0
        for r, before in zip(replicas, tokens0):
            r.extra["tokens_per_s"] = (r.tokens - before) / seconds
        return [done[k] for k in keys]

    def _aborted(self):
        with self.fleet.lock:
            self.stats["vllm/aborts"] = self.stats.get("vllm/aborts", 0) + 1
        raise GenerationAborted("vLLM generation aborted for a weight update")

    def _count_failures(self, failed: dict[Key, Exception], tries: dict[Key, int], bad_before: float) -> None:
        for k, e in failed.items():
            if isinstance(e, HttpStatusError) and e.status < 500:
                hint = (" (a server at a URL must run with --enable-scale-out, which mounts the token-in/token-out "
                        "endpoint)" if e.status in (403, 404) else "")
                raise VllmRequestError(f"the vLLM server refused sample {k}: {e}{hint}", e.status)
            if isinstance(e, BadResponse):
                self.stats["vllm/bad_responses"] += 1
            tries[k] += 1
        over = [k for k in failed if tries[k] > self.cfg.max_retries]
        if over:
            bad = [k for k in over if isinstance(failed[k], BadResponse)]
            reasons = [f"{k}: {failed[k]}" for k in over[:3]]
            if bad:
                count = int(self.stats["vllm/bad_responses"] - bad_before)
                raise VllmBadResponseError(
                    f"{len(over)} samples still got invalid answers after {self.cfg.max_retries} retries "
                    f"({count} bad answers in this call); e.g. {reasons}", count=count, examples=reasons)
            raise VllmServerDiedError(f"{len(over)} samples kept failing after {self.cfg.max_retries} retries: "
                                      f"{reasons}")

    def _round(self, keys: list[Key], requests: list[Request], policy_version: int):
        """Send `keys` once. -> (samples by key, failures by key to retry after a backoff). A
        request lost with its server is sent again at once (placed on a server that is READY);
        the server is taken out and restarted (fleet.lose). On abort: waits for every request
        sent, then raises GenerationAborted."""
        def send(key: Key) -> Future:
            self.stats["vllm/requests"] += 1
            return self._pool.submit(self._one, requests[key], policy_version)

        futures: dict[Future, Key] = {send(k): k for k in keys}
        ok: dict[Key, Sample] = {}
        failed: dict[Key, Exception] = {}
        last_check = time.monotonic()
        try:
            while futures and not self._aborting.is_set():
                finished, _ = wait([*futures, self._wake], timeout=self.cfg.health_interval_s,
                                   return_when=FIRST_COMPLETED)
                for f in finished - {self._wake}:
                    key = futures.pop(f)
                    e = f.exception()
                    if e is None:
                        ok[key] = f.result()
                        continue
                    if isinstance(e, _Dropped):
                        continue
                    if not isinstance(e, _Failed):
                        raise e
                    if isinstance(e.error, TransportError) and self._lost(e.replica, e.epoch, e.error):
                        self.stats["vllm/retries"] += 1
                        futures[send(key)] = key
                    else:
                        failed[key] = e.error
                if futures and time.monotonic() - last_check >= self.cfg.health_interval_s:
                    last_check = time.monotonic()
                    for r in self.fleet.pool.ready():
                        if r.in_flight and not r.server.alive():
                            self.fleet.lose(r, r.epoch, "server not alive (process gone or /health not answering)")
            if self._aborting.is_set():
                for f in futures:
                    f.cancel()
                self._abort_servers()
                wait(list(futures))  # every request thread has returned: nothing of this call runs on
                futures = {}
                self._aborted()
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
            reason = f"server hung or too slow: {e}"
        elif not replica.server.alive():
            reason = f"server died ({e})"
        else:
            return False
        self.fleet.lose(replica, epoch, reason)
        return True

    def _one(self, request: Request, policy_version: int) -> Sample:
        if self._aborting.is_set():
            raise _Dropped()
        prompt, sampling, (i, j) = list(request.prompt_ids), request.sampling, request.stream
        num_logprobs = self.max_logprobs if sampling.return_kept_ids else 0
        routed = self.arch.num_layers * self.arch.moe_topk if self.cfg.enable_return_routed_experts else 0
        cap = generate_answer_cap(len(prompt), sampling, num_logprobs, routed)
        with self.fleet.pool.serving(len(prompt) + sampling.max_tokens, self.cfg.startup_timeout_s, prompt) as replica:
            epoch, server = replica.epoch, replica.server
            body = generate_body(server.model_name, prompt, sampling, stream_seed(sampling.seed, i, j), num_logprobs)
            try:
                resp = request_json(server.url + GENERATE, body, timeout=self.cfg.request_timeout_s,
                                    api_key=server.api_key, max_bytes=cap, setting="rollout.vllm.request_timeout_s")
                out = parse_generate(resp, len(prompt), sampling, self.arch.vocab_size, self.max_model_len,
                                     num_logprobs)
            except AnswerTooLarge as e:
                why = AnswerTooLarge(f"{e}, the most a valid answer to a {len(prompt)}-token prompt with max_tokens="
                                     f"{sampling.max_tokens} and {num_logprobs} top log-probs per token takes (protocol."
                                     f"generate_answer_cap): the server does not answer as vLLM does")
                raise _Failed(why, replica, epoch) from e
            except (TransportError, HttpStatusError, BadResponse) as e:
                raise _Failed(e, replica, epoch) from e
        self.fleet.pool.add_tokens(replica, len(out.ids), [*prompt, *out.ids.tolist()])
        routed_experts = None
        if self.cfg.enable_return_routed_experts:
            routed_experts = decode_routed_experts(out.routed, len(prompt) + len(out.ids) - 1, self.arch.moe_topk)
        versions = out.versions
        mixed = versions is not None and bool((versions != versions[0]).any())
        return Sample(prompt_ids=torch.tensor(prompt, dtype=torch.long), response_ids=out.ids,
                      rollout_logprobs=out.logprobs, finish_reason=out.finish,
                      policy_version=int(versions[0]) if versions is not None else policy_version,
                      prompt_index=i, sample_index=j, routed_experts=routed_experts, kept_ids=out.kept,
                      token_versions=versions if mixed else None)

    def _check_args(self, requests: Sequence[Request]) -> None:
        if not self.fleet.started:
            raise VllmError("the vLLM engine has no weights yet: call load_weights_from() first (the server starts "
                            "on the first weights it is given)")
        check_requests(list(requests), self.arch.vocab_size)
        for k, r in enumerate(requests):
            if len(r.prompt_ids) + r.sampling.max_tokens > self.max_model_len:
                raise ValueError(f"request {k}: prompt of {len(r.prompt_ids)} tokens + max_tokens="
                                 f"{r.sampling.max_tokens} exceeds max_model_len={self.max_model_len} "
                                 f"(rollout.vllm.max_model_len)")
            if r.sampling.return_kept_ids and self.max_logprobs < 1:
                raise VllmUnsupportedError("return_kept_ids needs rollout.vllm.max_logprobs >= 1")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
