"""An engine's requests to its servers (any kind: its dialect; vLLM's VllmEngine) as coroutines: their
retries, failover, and a weight update in the middle.

    gen = Generation(arch, cfg, fleet, max_model_len, max_logprobs, check_sampling, decode_routed)  # fleet.dialect: the wire format
    samples = gen.generate(requests, version)      # one per rollout/types.py Request, in order (blocks)
    sample = await gen.sample(request, version)    # one request, from any event loop (rollout/requests.py)
    gen.abort() | gen.pause(); push the weights; gen.resume()       # trainer thread, while they run

Requests. One token-in/token-out request per `Request` of the call (rollout/types.py; a generate()
call's sample j of prompt i is request (i, j) of `requests_of`) in the servers' dialect
(dialect.py: its body, path, answer cap and parse; vLLM's `/inference/v1/generate`,
rollout/vllm/protocol.py), each with its own sampling settings: token ids in; token ids, per-token sampled
log-probs and each token's weight version out. Each request is one coroutine on the engine's event
loop (loop.py RequestLoop, held by the fleet: one thread for all of them) over async HTTP (ahttp.py), placed by the pool when it
may be sent (pool.py: least work in flight, prefix affinity) on a server with fewer than
`max_concurrency` of this engine's requests in flight (the per-server bound); a server batches
them (continuous batching). `generate` is one call of many requests, `sample` a call of one: each
sample of `sample` comes back as soon as its answer does. A request with stream (i, j) carries the seed
`stream_seed(sampling.seed, i, j)`, the
same derivation the embedded engine uses, so a sample depends on (weights, prompt, seed, i, j)
only: not on batching, concurrency, retries or which server ran it. (The two engines draw
different numbers from their streams, so their samples differ.)

Failures. Each request retries on its own; a call returns once every request has a validated
sample, and raises the first request's error that is not retried (the others are then cancelled).
- bad answer (malformed JSON, wrong lengths, missing / non-finite log-probs, inconsistent finish
  reason, longer than any valid answer to its request: the dialect's answer_cap, read no
  further than that): counted in `vllm/bad_responses`, retried after a backoff up to `max_retries` times per sample, then
  BadResponseError.
- HTTP 5xx or a dropped connection while the server stays healthy: retried (`vllm/retries`) with
  exponential backoff, up to `max_retries` per sample. HTTP 4xx: RequestError at once.
- server dead (process gone or /health failing, checked every `health_interval_s` while waiting)
  or hung (no whole answer within `request_timeout_s`, one deadline from connect to last byte:
  a server that trickles bytes is hung too): the server is taken out and restarted (fleet.py), and its
  unfinished samples are sent again at once (to the other servers; with one server, to it once
  it is back). `max_restarts` counts the restarts while calls run without a break.

Control calls. Abort, pause and resume are the dialect's (its abort_calls, pause_calls,
resume_calls; vLLM's development endpoints, rollout/vllm/dialect.py), sent
on the requests' event loop over their HTTP session to every server at once, each with the
request deadline (request_timeout_s); the trainer's thread waits for all of them.

Abort (train.in_flight_update=abort). `abort()` ends the calls in flight: requests not yet sent
are dropped, each server is asked to end the ones it runs (vLLM's `/abort_requests`, no ids:
all of them; the servers serve this engine alone, whose syncs set their weights), each call
waits until every request of it has returned and raises GenerationAborted (its samples are
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
Each answer's weight-version spans (the dialect's parse) give every token's version: the tokens before
the update carry the old one (Sample.token_versions). The call sees a pause only as slower
requests.

Cost: one request per sample spread over the servers (pool.py); per request in flight a coroutine
and a socket (no thread), and at most its answer cap of memory (the dialect's answer_cap), so
at most servers x max_concurrency of them; the answers are parsed on the loop (O(answer) each).
Threads: the loop's one, plus at most servers + 1 for the blocking checks of failures (alive(),
taking a server out).
The waits are event-driven (no polling beyond the health check every health_interval_s while
calls run); an abort or a pause costs one or two small requests per server, all servers at once:
the time of the slowest server's answer, not their sum.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.pausing import GenerationAborted
from megatron_rl.rollout.serving.config import ServingConfig
from megatron_rl.rollout.serving.errors import (
    BadResponseError,
    RequestError,
    ServerDiedError,
    ServingError,
    UnsupportedError,
)
from megatron_rl.rollout.serving.fleet import Fleet
from megatron_rl.rollout.serving.http import AnswerTooLarge, BadResponse, HttpStatusError, TransportError
from megatron_rl.rollout.serving.loop import LoopThread, RequestLoop
from megatron_rl.rollout.serving.pool import READY, Replica
from megatron_rl.rollout.types import Request, Sample, SamplingParams, check_requests, stream_seed

log = logging.getLogger("megatron_rl.rollout.serving")


class _Failed(Exception):
    """A request that failed on `replica` while it ran its start number `epoch`."""

    def __init__(self, error: Exception, replica: Replica, epoch: int):
        super().__init__(str(error))
        self.error, self.replica, self.epoch = error, replica, epoch


class Generation:
    """Sends requests and collects their samples (module docstring). The state below the loop
    line is the loop's: touched only by coroutines on it (the trainer thread goes through
    `LoopThread.call`).

    What is the engine kind's own comes in with it: `check_sampling(sampling)` refuses settings
    whose log-probs its servers do not return as the trainer needs them (UnsupportedError; vLLM's:
    protocol.check_served under its log-prob mode), and `decode_routed(routed, tokens, topk)` turns
    an answer's routed experts (Parsed.routed) into [tokens, topk] int (vLLM's:
    protocol.decode_routed_experts; used when cfg.routed_experts)."""

    def __init__(self, arch: ModelArch, cfg: ServingConfig, fleet: Fleet, max_model_len: int, max_logprobs: int,
                 check_sampling: Callable[[SamplingParams], None] = lambda sampling: None,
                 decode_routed: Callable[[str | None, int, int], torch.Tensor] | None = None):
        self.arch, self.cfg, self.fleet = arch, cfg, fleet
        self.dialect = fleet.dialect  # the servers' wire format: one for the engine
        self.max_model_len, self.max_logprobs = max_model_len, max_logprobs
        self.check_sampling, self.decode_routed = check_sampling, decode_routed
        self.stats = fleet.stats
        self.requests: RequestLoop = fleet.requests  # the engine's request loop and HTTP session (fleet.py's)
        fleet.pool.on_change.append(self._wake_threadsafe)
        # the blocking checks of a failed request (alive(), fleet.lose): close() waits for them
        self._fleet_work = ThreadPoolExecutor(len(fleet.replicas) + 1, thread_name_prefix="serving-fleet")
        # ---- the loop's
        self._open = asyncio.Event()  # set: calls may start (cleared from abort() / pause() to resume())
        self._open.set()
        self._aborting = False  # set by abort(): the calls running end with GenerationAborted
        self._active = 0  # calls running (a generate() call, or one request from sample())
        self._burst: tuple[float, list[int]] = (0.0, [])  # (start, each server's tokens) of the calls running
        self._idle = asyncio.Event()  # set while no call runs
        self._idle.set()
        self._changed = asyncio.Event()  # replaced once set: wakes the requests waiting for a slot
        self._slots = {r.index: 0 for r in fleet.replicas}  # requests in flight per server
        self._watch: asyncio.Task | None = None  # the health check while calls run

    # ---- the loop -------------------------------------------------------------------------------
    def _started(self) -> LoopThread:
        return self.requests.started()

    def _wake_threadsafe(self) -> None:
        loop = self.requests.running
        if loop is None:  # not started yet (nobody waits), or closed
            return
        try:
            loop.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: nobody waits
            pass

    def _wake(self) -> None:
        """Wake every request waiting for a slot, a server or an abort (on the loop)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _changes(self, timeout: float | None) -> bool:
        """Wait for _wake() (False: `timeout` passed first)."""
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
            return True
        except TimeoutError:
            return False

    # ---- abort and pause (the trainer thread) ---------------------------------------------------
    def abort(self) -> None:
        """Make the calls in flight raise GenerationAborted; return once they have ended (at once
        when none runs). Calls wait for resume() before starting."""
        if not self._started().call(self._hold(abort=True)):
            return
        with self.fleet.lock:
            self.stats["vllm/aborts"] = self.stats.get("vllm/aborts", 0) + 1
        self._abort_servers()
        self._started().call(self._idle.wait())

    async def _hold(self, abort: bool) -> bool:
        """No call starts until resume(); with `abort`, the running ones end. -> whether any runs."""
        self._open.clear()
        if abort and self._active:
            self._aborting = True
            self._wake()
        return self._active > 0

    async def _release(self) -> None:
        self._aborting = False
        self._open.set()

    def pause(self) -> None:
        """Freeze the calls in flight on every READY server (module docstring); return once they all
        are (at once when no call runs). Calls wait for resume() before starting. A server that
        does not answer is taken out (its requests go to the others after resume)."""
        if not self._started().call(self._hold(abort=False)):
            return
        with self.fleet.lock:
            self.stats["vllm/pauses"] = self.stats.get("vllm/pauses", 0) + 1
        ready = self.fleet.pool.ready()
        errors = self._control_all(ready, lambda r: self.dialect.pause_calls())
        self.fleet.paused.update(r.index for r, e in zip(ready, errors, strict=True) if e is None)
        refused = next(((r, e) for r, e in zip(ready, errors, strict=True) if isinstance(e, HttpStatusError)), None)
        if refused is not None:
            self.resume()  # the servers frozen so far go on, and calls may start: the run stops on the error
            r, e = refused
            raise UnsupportedError(f"{self.dialect.name} {r.name()} refused to pause ({e}): a pause needs "
                                   f"{self.dialect.control_hint}") from e
        for r, e in zip(ready, errors, strict=True):
            if e is not None:
                self.fleet.lose(r, r.epoch, f"did not pause for a weight update: {e}")

    def resume(self) -> None:
        """End an abort() or a pause(): frozen requests go on (on the weights pushed meanwhile)."""
        self._resume_servers()
        self._started().call(self._release())

    def _resume_servers(self) -> None:
        paused = [r for r in self.fleet.replicas if r.index in self.fleet.paused]
        self.fleet.paused.clear()
        paused = [r for r in paused if r.state == READY]  # lost or restarted meanwhile: nothing of it is frozen
        for r, e in zip(paused, self._control_all(paused, lambda r: self.dialect.resume_calls()), strict=True):
            if e is not None:
                self.fleet.lose(r, r.epoch, f"did not resume after a weight update: {e}")

    def _abort_servers(self) -> None:
        """Ask every READY server to end the requests it runs (see the module docstring). A request
        that reaches its server after this runs to its end: abort() then waits for it. A paused
        server (an abort after pause(): the weight push failed), whatever its state, has its
        frozen requests ended (the dialect's abort of a paused server) and stays paused: resume()
        does not let it go on, since its weights may be half loaded (the pool has marked it out)."""
        frozen = [r for r in self.fleet.replicas if r.index in self.fleet.paused]
        self.fleet.paused.difference_update(r.index for r in frozen)
        servers = frozen + [r for r in self.fleet.pool.ready() if r not in frozen]
        for r, e in zip(servers, self._control_all(servers, lambda r: self.dialect.abort_calls(r in frozen)),
                        strict=True):
            if e is not None:
                log.info("%s %s did not abort its requests (%s): they run to their end", self.dialect.name,
                         r.name(), e)

    def _control_all(self, replicas: list[Replica], calls_of) -> list[Exception | None]:
        """Send each replica its control calls `calls_of(replica)` (in order), every replica at once,
        on the requests' loop; -> each one's failure (TransportError, HttpStatusError, BadResponse)
        or None. Blocks the calling thread (never the loop's) until all have answered."""
        return self._started().call(self._control_gather([(r, calls_of(r)) for r in replicas]))

    async def _control_gather(self, sends) -> list[Exception | None]:
        async def one(replica: Replica, calls) -> Exception | None:
            server = replica.server
            try:
                for call in calls:
                    answer = await self.requests.json(server.url + call.path,
                                                      call.body if call.method == "POST" else None,
                                                      timeout=self.cfg.request_timeout_s, api_key=server.api_key,
                                                      setting=f"{self.cfg.section}.request_timeout_s")
                    self.dialect.read_control(call, answer)
            except (TransportError, HttpStatusError, BadResponse) as e:
                return e
            return None

        return list(await asyncio.gather(*(one(r, calls) for r, calls in sends)))

    # ---- calls ----------------------------------------------------------------------------------
    def generate(self, requests: Sequence[Request], version: Callable[[], int]) -> list[Sample]:
        """One sample per request, in order, each tagged `version()` (read once the call may start:
        a call held by abort() runs on the weights pushed meanwhile). Blocks the calling thread."""
        self._check_args(requests)
        return self._started().call(self._call(list(requests), version))

    async def sample(self, request: Request, version: Callable[[], int]) -> Sample:
        """The sample of one request, awaited from any event loop (the request runs on the engine's
        loop; cancelling the await cancels it). A call of its own: abort() ends it, pause() holds
        its start."""
        self._check_args([request])
        future = self._started().submit(self._call([request], version))
        return (await asyncio.wrap_future(future))[0]

    async def _call(self, requests: list[Request], version: Callable[[], int]) -> list[Sample]:
        while not self._open.is_set():  # a call never starts during an update
            await self._open.wait()
        policy_version = version()
        self._enter()
        tasks = [asyncio.ensure_future(self._request(r, policy_version)) for r in requests]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
            if self._aborting:  # every request of the call returns first: nothing of it runs on
                await asyncio.wait(tasks)
                for t in tasks:
                    if not t.cancelled():
                        t.exception()  # retrieved: the call's one error is the abort
                raise GenerationAborted(f"{self.dialect.name} generation aborted for a weight update")
            if failed:
                raise failed[0].exception()
            return [t.result() for t in tasks]
        finally:
            left = [t for t in tasks if not t.done()]  # after a fatal error, or when the caller cancelled
            for t in left:
                t.cancel()  # their connections close: a moment, not their answers
            if left:
                await asyncio.wait(left)  # so that once no call is active, no request holds a slot
                for t in left:
                    if not t.cancelled():
                        t.exception()  # retrieved: only the first error is raised
            self._leave()

    def _enter(self) -> None:
        if self._active == 0:
            self.fleet.call_restarts = 0  # max_restarts counts per burst of calls
            self._burst = (time.perf_counter(), [r.tokens for r in self.fleet.replicas])
            self._idle.clear()
            self._watch = asyncio.ensure_future(self._watchdog())
        self._active += 1

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._watch.cancel()
            self._idle.set()
            # each server's throughput over the burst of calls just ended (generate() or sample()s)
            t0, tokens0 = self._burst
            seconds = max(time.perf_counter() - t0, 1e-9)
            for r, before in zip(self.fleet.replicas, tokens0, strict=True):
                r.extra["tokens_per_s"] = (r.tokens - before) / seconds

    async def _watchdog(self) -> None:
        """Every health_interval_s while calls run: a READY server with requests in flight whose
        process is gone or whose /health fails is taken out (its requests fail fast and are resent)."""
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            for r in self.fleet.pool.ready():
                if r.in_flight and not await self._blocking(r.server.alive):
                    try:
                        await self._blocking(self.fleet.lose, r, r.epoch,
                                                "server not alive (process gone or /health not answering)")
                    except ServerDiedError as e:  # its requests fail with it as they find no server
                        log.error("%s", e)

    # ---- one request ----------------------------------------------------------------------------
    async def _request(self, request: Request, policy_version: int) -> Sample:
        """One request's sample, retried as the module docstring says."""
        tries, bad, backoff = 0, 0, self.cfg.retry_backoff_s
        while True:
            if self._aborting:
                raise GenerationAborted(f"{self.dialect.name} generation aborted for a weight update")
            try:
                return await self._one(request, policy_version)
            except _Failed as failed:
                e = failed.error
                if self._aborting:  # ended by the abort (finish_reason "abort"): not a fault
                    raise GenerationAborted(f"{self.dialect.name} generation aborted for a weight update") from None
                if isinstance(e, TransportError) and await self._lost(failed.replica, failed.epoch, e):
                    self.stats["vllm/retries"] += 1
                    continue
                if isinstance(e, HttpStatusError) and e.status < 500:
                    hint = (f" (a server at a URL must serve {self.dialect.name}'s token-in/token-out endpoint "
                            f"{self.dialect.generate_path})" if e.status in (403, 404) else "")
                    raise RequestError(f"the {self.dialect.name} server refused sample {request.stream}: {e}{hint}",
                                       e.status) from None
                if isinstance(e, BadResponse):
                    self.stats["vllm/bad_responses"] += 1
                    bad += 1
                tries += 1
                if tries > self.cfg.max_retries:
                    self._give_up(request, e, bad)
                self.stats["vllm/retries"] += 1
                await self._changes(backoff)  # an abort ends the wait
                backoff *= 2

    def _give_up(self, request: Request, e: Exception, bad: int):
        reason = f"{request.stream}: {e}"
        if isinstance(e, BadResponse):
            raise BadResponseError(f"sample {request.stream} still got invalid answers after {self.cfg.max_retries} "
                                   f"retries ({bad} bad answers); e.g. {reason}", count=bad, examples=[reason])
        raise ServerDiedError(f"sample {request.stream} kept failing after {self.cfg.max_retries} retries: "
                              f"{reason}")

    async def _lost(self, replica: Replica, epoch: int, e: TransportError) -> bool:
        """Whether a dropped request went down with its server (-> resend; the server is taken
        out) rather than being a one-off (-> retry after a backoff)."""
        if epoch != replica.epoch or replica.state != READY:
            return True  # in flight when that server went down: already handled
        if e.timed_out:
            reason = f"server hung or too slow: {e}"
        elif not await self._blocking(replica.server.alive):
            reason = f"server died ({e})"
        else:
            return False
        await self._blocking(self.fleet.lose, replica, epoch, reason)
        return True

    async def _blocking(self, fn, *args):
        """`fn(*args)` in a fleet-work thread. A cancelled caller (its call ended on another request's
        error) still waits for it: a call returns only once what it started on the fleet (taking a
        server out, stopping it) is done, never leaving it to race the caller's next step."""
        done = asyncio.get_running_loop().run_in_executor(self._fleet_work, fn, *args)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            await asyncio.wait([done])
            raise

    async def _place(self, work: int, tokens: list[int]) -> Replica:
        """The server a request goes to (pool.py's choice among those below their bound of
        max_concurrency requests in flight), waiting for a slot or a server to come back. While
        every slot is taken (servers x max_concurrency) the request waits without asking the pool:
        it is placed, or told that no server can serve, only once it could be sent."""
        while True:
            if self._aborting:
                raise GenerationAborted(f"{self.dialect.name} generation aborted for a weight update")
            if sum(self._slots.values()) >= self.cfg.max_concurrency * len(self._slots):
                await self._changes(None)  # every slot taken: the pool is asked once one frees
                continue
            full = frozenset(k for k, n in self._slots.items() if n >= self.cfg.max_concurrency)
            replica = self.fleet.pool.take(work, tokens, full)
            if replica is not None:
                self._slots[replica.index] += 1
                return replica
            none_ready = not self.fleet.pool.ready()
            timeout = self.cfg.startup_timeout_s if none_ready else None
            if not await self._changes(timeout) and not self.fleet.pool.ready():
                raise ServerDiedError(f"no {self.dialect.name} server of the pool became ready within {timeout:g} s")

    async def _one(self, request: Request, policy_version: int) -> Sample:
        prompt, sampling, (i, j) = list(request.prompt_ids), request.sampling, request.stream
        num_logprobs = self.max_logprobs if sampling.return_kept_ids else 0
        routed = self.arch.num_layers * self.arch.moe_topk if self.cfg.routed_experts else 0
        dialect = self.dialect
        cap = dialect.answer_cap(len(prompt), sampling, num_logprobs, routed)
        work = len(prompt) + sampling.max_tokens
        replica = await self._place(work, prompt)
        self.stats["vllm/requests"] += 1
        epoch, server = replica.epoch, replica.server
        body = dialect.generate_body(server.model_name, prompt, sampling, stream_seed(sampling.seed, i, j), num_logprobs)
        try:
            resp = await self.requests.json(server.url + dialect.generate_path, body,
                                            timeout=self.cfg.request_timeout_s, api_key=server.api_key,
                                            max_bytes=cap, setting=f"{self.cfg.section}.request_timeout_s")
            out = dialect.parse_generate(resp, len(prompt), sampling, self.arch.vocab_size, self.max_model_len,
                                         num_logprobs)
        except AnswerTooLarge as e:
            why = AnswerTooLarge(f"{e}, the most a valid answer to a {len(prompt)}-token prompt with max_tokens="
                                 f"{sampling.max_tokens} and {num_logprobs} top log-probs per token takes ("
                                 f"{dialect.name}'s answer_cap): the server does not answer as {dialect.name} does")
            raise _Failed(why, replica, epoch) from e
        except (TransportError, HttpStatusError, BadResponse) as e:
            raise _Failed(e, replica, epoch) from e
        finally:
            self.fleet.pool.release(replica, work)
            self._slots[replica.index] -= 1
            self._wake()
        self.fleet.pool.add_tokens(replica, len(out.ids), [*prompt, *out.ids.tolist()])
        routed_experts = None
        if self.cfg.routed_experts:
            routed_experts = self.decode_routed(out.routed, len(prompt) + len(out.ids) - 1, self.arch.moe_topk)
        versions = out.versions
        mixed = versions is not None and bool((versions != versions[0]).any())
        return Sample(prompt_ids=torch.tensor(prompt, dtype=torch.long), response_ids=out.ids,
                      rollout_logprobs=out.logprobs, finish_reason=out.finish,
                      policy_version=int(versions[0]) if versions is not None else policy_version,
                      prompt_index=i, sample_index=j, routed_experts=routed_experts, kept_ids=out.kept,
                      token_versions=versions if mixed else None, cached_tokens=out.cached_tokens)

    def _check_args(self, requests: Sequence[Request]) -> None:
        if not self.fleet.started:
            raise ServingError(f"the {self.dialect.name} engine has no weights yet: call load_weights_from() first (the "
                               f"server starts on the first weights it is given)")
        check_requests(list(requests), self.arch.vocab_size)
        for k, r in enumerate(requests):
            if len(r.prompt_ids) + r.sampling.max_tokens > self.max_model_len:
                raise ValueError(f"request {k}: prompt of {len(r.prompt_ids)} tokens + max_tokens="
                                 f"{r.sampling.max_tokens} exceeds max_model_len={self.max_model_len} "
                                 f"({self.cfg.section}.max_model_len)")
            if r.sampling.return_kept_ids and self.max_logprobs < 1:
                raise UnsupportedError(f"return_kept_ids needs {self.cfg.section}.max_logprobs >= 1")
        for sampling in {r.sampling for r in requests}:
            self.check_sampling(sampling)

    def close(self) -> None:
        """Stop the requests still running and the loop's thread (the engine's request loop: closed
        for the fleet too)."""
        self.requests.close()
        self._fleet_work.shutdown(wait=True)  # a restart it began has started (fleet.close stops it)
