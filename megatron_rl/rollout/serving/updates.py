"""New weights into an engine's servers (any kind: its dialect's receivers; vLLM's VllmEngine), each
sync checked by the parity probe. The one owner of the order of pause, weight update and resume
on the servers (with generation.py, which pauses and resumes them for a partial rollout).

    updates = WeightUpdates(arch, cfg, weight_sync, fleet, push, max_model_len)   # push: the kind's Push or None
    updates.update_weights(named_tensors, version, reference)   # weight_sync=memory (vLLM: transfer.py)
    updates.load_weights_from(model_dir, version, reference)    # reload / restart (vLLM: weight_sync.py)

The first sync starts the servers (fleet.py) on those weights. Disk: a server dead during a
sync is restarted on the new weights (a fresh start loads them) when `max_restarts` >= 1 (it
bounds each sync as it bounds each generate() call). Memory: a server found dead before the
sync, or dropped during it (failed, stopped answering /health, or past `sync_timeout_s`: the
engine's push, vLLM's transfer.push_all), is taken out and restarted in the background on random weights (STALE: it
serves nothing) and filled by the next sync; the sync goes on to the others. When it reaches
none, ServerDiedError names each server and why, and the servers it left half updated are
FAILED (never resumed or served; the next sync restarts them). After every `probe_every`-th sync (the first too) each READY server answers the parity
probe (probe.py) against `reference` (None: transformers fp32 on the folder, or on the stream
for an in-memory sync); ParityError past `probe_tolerance`. A sync inside a partial rollout
(`fleet.paused`: the servers whose requests the generation froze, generation.py) leaves them
paused and its probe waits for `after_resume()`: a paused server answers nothing.

Every sync labels each server's weights with the trainer version (vLLM's weight version: the
in-memory sync's finish sets it, a reload is followed by the dialect's version_label, vLLM's
/update_weight_version), so each answer says which version made each token (vLLM: protocol.py).
A restarted server starts unlabelled. The label and the probe's
scoring request are requests on the engine's loop (fleet.requests, loop.py); the probe's reference
runs in the calling thread.

Cost: per sync, each server loads the whole model (disk: from the folder, all servers at once;
memory: the bytes once per server worker through the trainer, the push) and answers
one probe of `probe_tokens` tokens; the streamed reference holds an fp32 copy of the model on
the engine's rank while it lives.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_rl.model.arch import ModelArch
from megatron_rl.rollout.serving.config import ServingConfig
from megatron_rl.rollout.serving.errors import ParityError, ServerDiedError, ServingError
from megatron_rl.rollout.serving.fleet import Fleet
from megatron_rl.rollout.serving.http import HttpStatusError, TransportError
from megatron_rl.rollout.serving.pool import FAILED, READY, STALE, Replica
from megatron_rl.rollout.serving.probe import (
    Reference,
    StreamedReference,
    hf_reference,
    probe_diff,
    probe_tokens,
)
from megatron_rl.rollout.serving.receivers import DiskReceiver, Push, Watch

log = logging.getLogger("megatron_rl.rollout.serving")


class WeightUpdates:
    """The engine's two weight receivers (module docstring), the servers' dialect's (fleet.dialect:
    its disk_receiver, version_label; the replicas' memory receivers). weight_sync: rollout.weight_sync
    (resolved: memory, reload, restart). `push`: the kind's in-memory sync over the replicas' receivers
    (receivers.py Push; vLLM's transfer.push_all), None for disk syncs."""

    def __init__(self, arch: ModelArch, cfg: ServingConfig, weight_sync: str, fleet: Fleet, push: Push | None,
                 max_model_len: int):
        self.arch, self.cfg, self.weight_sync, self.fleet, self.push = arch, cfg, weight_sync, fleet, push
        self.max_model_len = max_model_len
        self.stats = fleet.stats
        self.sync: DiskReceiver = fleet.dialect.disk_receiver(weight_sync)  # a folder's loader (disk syncs)
        self._syncs = 0
        self._deferred_probe: tuple[str, Reference] | None = None  # a paused sync's, run by after_resume()

    def update_weights(self, named_tensors, version: int, reference: Reference | None) -> None:
        """Stream HF checkpoint-format (name, tensor) pairs into every server (see
        VllmEngine.update_weights)."""
        fleet, kind = self.fleet, self.fleet.dialect.name
        if self.push is None:
            raise ServingError(f"rollout.weight_sync={self.weight_sync} takes HF folders (load_weights_from, the "
                               f"disk transport), not tensors in memory")
        t0 = time.perf_counter()
        if not fleet.started:
            fleet.start(fleet.config_dir())
        fleet.await_restarts()
        for r in fleet.replicas:
            if r.state == FAILED and r.server.can_restart and not fleet.stopping():
                try:  # out since a restart failed or the restart budget ran out: on random weights, joins this push
                    fleet.restart(r, fleet.config_dir(), r.why)
                except (ServingError, OSError) as e:
                    log.warning("%s %s stays out of the pool: %s", kind, r.name(), e)
        for r in fleet.replicas:  # a server that died since the last call: out, restarted, not pushed to
            if r.state in (READY, STALE) and not r.server.alive():
                fleet.lose(r, r.epoch, f"found dead before the in-memory sync of version {version}")
        targets = [r for r in fleet.replicas if r.state in (READY, STALE)]
        if not targets:
            raise ServerDiedError(f"no {kind} server of the pool is up for the in-memory weight sync: " + "; ".join(
                f"{r.name()} {r.state}: {r.why}" for r in fleet.replicas))
        probed = self._probes_next()
        streamed = StreamedReference(self.arch) if probed and reference is None else None
        named = streamed.tee(named_tensors) if streamed is not None else named_tensors
        by_sync = {r.memory: r for r in targets}
        section = self.cfg.section
        watch = Watch(self.cfg.sync_timeout_s, f"{section}.sync_timeout_s", lambda s: by_sync[s].server.alive(),
                      self.cfg.health_interval_s, f"{section}.health_timeout_s={self.cfg.health_timeout_s:g} s")
        try:
            pushed = self.push(list(by_sync), named, version, self.cfg.request_timeout_s,
                               held=[r.memory for r in targets if r.index in fleet.paused], watch=watch)
        except Exception as e:
            self._torn(targets, f"the in-memory sync of version {version} failed reading the trainer's weights "
                                f"({type(e).__name__}: {e})")
            raise
        self.stats["timing/vllm_memory_sync"] = pushed.seconds
        failed = {by_sync[s]: why for s, why in pushed.failed.items()}
        if len(failed) == len(targets):
            self._torn(targets, f"half updated by the failed in-memory sync of version {version}")
            raise ServerDiedError(f"the in-memory weight sync of version {version} reached no {kind} server: " +
                                  "; ".join(f"{r.name()} {why}" for r, why in failed.items()) +
                                  f". Their weights are half updated. Logs: "
                                  f"{', '.join(r.server.log_where for r in targets)}")
        for r in targets:
            if r not in failed:
                fleet.pool.set_state(r, READY)
        for r, why in failed.items():  # half updated: restarted before it serves again, filled by the next sync
            log.warning("%s %s dropped from the in-memory sync of version %d: %s", kind, r.name(), version, why)
            fleet.lose(r, r.epoch, f"dropped from the in-memory sync of version {version}: {why}")
        self._synced(f"the in-memory sync of version {version}",
                     streamed.reference if streamed is not None else reference, probed, t0)

    def _torn(self, targets: list[Replica], why: str) -> None:
        """The servers a failed sync left half updated (and paused) serve nothing more (FAILED):
        neither new requests nor a resume of their frozen ones; the next sync restarts them."""
        for r in targets:
            self.fleet.pool.set_state(r, FAILED, why)

    def load_weights_from(self, model_dir: str, version: int, reference: Reference | None) -> None:
        """Make every server serve the HF folder `model_dir` (see VllmEngine.load_weights_from)."""
        fleet = self.fleet
        if self.push is not None:
            raise ServingError("rollout.weight_sync=memory takes tensors in memory (update_weights, the memory "
                               "transport), not folders")
        t0 = time.perf_counter()
        fleet.dirs.add(model_dir)
        if not fleet.started:
            fleet.start(model_dir)
        else:
            fleet.await_restarts()
            with ThreadPoolExecutor(len(fleet.replicas)) as pool:
                outcomes = [(r, pool.submit(self._load_on, r, model_dir, version)) for r in fleet.replicas]
            errors = []
            for r, f in outcomes:
                if f.exception() is not None:
                    fleet.pool.set_state(r, FAILED, str(f.exception()))
                    errors.append(f.exception())
            if len(errors) == len(fleet.replicas):
                raise errors[0]
            for e in errors:
                log.warning("a %s server is left out of the pool: %s", fleet.dialect.name, e)
        self._synced(f"the weight sync to {model_dir}", reference or hf_reference(model_dir), self._probes_next(), t0)
        fleet.dirs.prune()

    def _load_on(self, replica: Replica, model_dir: str, version: int) -> None:
        if replica.state != READY:  # down since the last sync: a start on the new folder loads it
            return self._sync_failed(replica, model_dir, replica.why or replica.state)
        try:
            timings = self.sync.apply(replica.server, model_dir, self.cfg.request_timeout_s,
                                      lambda: self.fleet.warmup(replica))
            label = self.fleet.dialect.version_label(version)  # reloaded in place: the tokens from now on
            if "timing/vllm_restart" not in timings and label is not None:  # are `version`'s
                requests = self.fleet.requests  # on the engine's request loop
                requests.call(requests.json(replica.server.url + label.path, label.body if label.method == "POST"
                                            else None, timeout=self.cfg.request_timeout_s,
                                            api_key=replica.server.api_key))
        except (TransportError, HttpStatusError) as e:
            return self._sync_failed(replica, model_dir, e)
        if "timing/vllm_restart" in timings:  # RestartSync: a new process
            replica.epoch += 1
        with self.fleet.lock:
            self.stats.update(timings)
        return None

    def _probes_next(self) -> bool:
        """Whether the parity probe runs after the next sync (every probe_every-th, the first too)."""
        return bool(self.cfg.probe_every) and self._syncs % self.cfg.probe_every == 0

    def _synced(self, what: str, reference: Reference, probe: bool, t0: float) -> None:
        self._syncs += 1
        self.stats["vllm/weight_syncs"] = self._syncs
        if probe and self.fleet.paused:
            self._deferred_probe = (what, reference)
        elif probe:
            self._probe_all(what, reference)
        self.stats["timing/vllm_weight_sync"] = time.perf_counter() - t0

    def after_resume(self) -> None:
        """The parity probe of a sync made while the generation was paused, now that the servers
        answer again (ParityError as after any sync)."""
        deferred, self._deferred_probe = self._deferred_probe, None
        if deferred is not None:
            self._probe_all(*deferred)

    def _probe_all(self, what: str, reference: Reference) -> None:
        self.stats["vllm/probe_max_abs_diff"] = max(self._probe(r, what, reference) for r in self.fleet.pool.ready())

    def _sync_failed(self, replica: Replica, model_dir: str, e: Exception | str) -> None:
        """A server that failed at (or was down before) a weight sync: one restart, which loads
        `model_dir` as a fresh start does, when max_restarts allows one (it bounds the restarts of
        a load_weights_from() call as it does those of a generate() call)."""
        server = replica.server
        if not server.can_restart or (replica.state == READY and server.alive()):
            raise ServerDiedError(f"weight sync to {model_dir} failed: {e}")
        if self.cfg.max_restarts < 1:
            raise ServerDiedError(f"the {self.fleet.dialect.name} server died during the weight sync to {model_dir} "
                                  f"({e}) and {self.cfg.section}.max_restarts=0 allows no restart. Log: "
                                  f"{server.log_where}")
        self.fleet.restart(replica, model_dir, f"died during the weight sync: {e}")

    def _probe(self, replica: Replica, what: str, reference: Reference) -> float:
        """The parity probe on one server (one scoring request: cheap enough for each)."""
        tokens = probe_tokens(self.arch.vocab_size, min(self.cfg.probe_tokens, self.max_model_len - 1))
        server = replica.server
        diff = probe_diff(self.fleet.requests, server.url, server.model_name, tokens, reference,
                          self.cfg.request_timeout_s,
                          api_key=server.api_key, dialect=self.fleet.dialect, section=self.cfg.section)
        replica.extra["probe_max_abs_diff"] = diff
        tol = self.cfg.probe_tolerance
        if not diff <= tol:
            raise ParityError(f"after {what} the {self.fleet.dialect.name} server at {server.url}'s log-probs differ "
                              f"from the reference by {diff:.3g} > {tol:g} ({self.cfg.section}.probe_tolerance): the "
                              f"server is not running the exported weights", diff)
        return diff
