"""A pool of servers (of one kind, any kind: serving/dialect.py) behind one engine (vLLM's
VllmEngine): which server takes the next request, and each server's state and counters.

    pool = ServerPool([Replica(0, server0, memory0), Replica(1, server1, memory1)], kind=dialect.name)
    with pool.serving(work) as replica:      # the ready server with the least work in flight
        request_json(replica.server.url + dialect.generate_path, ...)
    pool.set_state(replica, DOWN)            # excluded until it is ready again

Placement. A request is placed when it may be sent (a free slot of the per-server bound,
generation.py), on the READY server with the least work in flight, work = prompt tokens + max_tokens
(the KV cache it may need); a tie goes round: to the first tied server after the one that took the
last request (an idle pool, whose servers all tie at 0, spreads requests one by one instead of
sending each to server 0). A slow server (fewer devices, a longer
queue) so gets fewer requests, and a server that dies is simply not picked any more. With
affinity (rollout.vllm.affinity, affinity.py), a request whose tokens start with a prefix the pool
has sent to a READY server goes there instead (the n samples of a prompt, the later turns of a
trajectory: that server's prefix cache holds the shared part), unless that server carries more than
AFFINITY_SLACK requests' worth of work beyond the least loaded one. Placement never changes a
sample: request (i, j) carries its own seed (generation.py), so any server gives the same sample
from the same weights.

States. READY serves. DOWN: found dead or hung, being stopped / restarted (not picked). STALE:
restarted with `weight_sync=memory`, so it runs random weights until the next in-memory sync
reaches it (the engine keeps no copy of the streamed weights to push them at once); not picked.
FAILED: its restart failed, or it cannot be restarted (a server at a URL); not picked again.
When no server is READY, a request waits for one (a restart in progress) and fails with
ServerDiedError once none can become READY.

Metrics keep vLLM's names (`vllm/server{k}/...`, `vllm/affinity/...`) whatever the kind.

Cost: placement is O(servers + prompt / 16) under one lock per request; the prefix table is
bounded (affinity.py); nothing grows with model or batch.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from megatron_rl.rollout.serving.affinity import PrefixTable
from megatron_rl.rollout.serving.errors import ServerDiedError
from megatron_rl.rollout.serving.handle import ServerHandle
from megatron_rl.rollout.serving.receivers import Receiver

READY, DOWN, STALE, FAILED = "ready", "down", "stale", "failed"
# how far past the least loaded server a prefix's server may be and still take the request, in
# multiples of the request's own work: a few requests' worth keeps the cache where it is without
# letting one server take a whole batch
AFFINITY_SLACK = 4


@dataclass(eq=False)
class Replica:
    """Server k of the pool. `epoch` counts its starts: a failure seen on an older epoch is a
    request that was in flight when it went down, not a new fault. `memory`: its in-memory weight
    receiver (receivers.py; vLLM's: one weight-transfer group per server), None for disk syncs."""

    index: int
    server: ServerHandle
    memory: Receiver | None = None
    state: str = DOWN
    epoch: int = 0
    in_flight: int = 0
    requests: int = 0
    tokens: int = 0
    restarts: int = 0
    why: str = ""
    extra: dict = field(default_factory=dict)

    def name(self) -> str:
        return f"server{self.index} ({self.server.url})"


class ServerPool:
    """The replicas and the lock that guards their state and load (module docstring). kind: how
    messages name the servers' kind (dialect.name)."""

    def __init__(self, replicas: list[Replica], affinity: bool = True, kind: str = "inference"):
        self.replicas = replicas
        self.kind = kind
        self._cond = threading.Condition()
        self.prefixes = PrefixTable() if affinity and len(replicas) > 1 else None
        self.affinity_requests = self.affinity_tokens = self.affinity_passed = 0
        self._last = -1  # the server that took the last request: a tie goes to the next one round
        self.on_change: list[Callable[[], None]] = []  # called after each state change, from any thread

    def __len__(self) -> int:
        return len(self.replicas)

    def ready(self) -> list[Replica]:
        with self._cond:
            return [r for r in self.replicas if r.state == READY]

    def set_state(self, replica: Replica, state: str, why: str = "") -> None:
        with self._cond:
            replica.state, replica.why = state, why
            if state != READY and self.prefixes is not None:  # a restart empties its cache
                self.prefixes.forget(replica.index)
            self._cond.notify_all()
        for wake in self.on_change:
            wake()

    def hopeless(self) -> bool:
        """No server is READY and none is on its way back (DOWN = a restart in progress)."""
        with self._cond:
            return not any(r.state in (READY, DOWN) for r in self.replicas)

    def _pick(self, timeout: float, work: int, tokens) -> Replica:
        with self._cond:
            while True:
                replica = self._choose(work, tokens)
                if replica is not None:
                    return replica
                if not self._cond.wait(timeout):
                    raise ServerDiedError(f"no {self.kind} server of the pool became ready within {timeout:g} s")

    def _choose(self, work: int, tokens, full: frozenset[int] = frozenset()) -> Replica | None:
        """The READY server (not in `full`) a request goes to, None when none is READY or all READY
        ones are full; ServerDiedError when none is on its way back either (under the lock)."""
        ready = [r for r in self.replicas if r.state == READY]
        if not ready and not any(r.state == DOWN for r in self.replicas):
            raise ServerDiedError(f"no {self.kind} server of the pool can serve: " + "; ".join(
                f"{r.name()} {r.state}: {r.why or '-'}" for r in self.replicas))
        free = [r for r in ready if r.index not in full]
        if not free:
            return None
        n = len(self.replicas)
        least = min(free, key=lambda r: (r.in_flight, (r.index - self._last - 1) % n))
        return self._prefix_owner(tokens, least, work, full) or least

    def _prefix_owner(self, tokens, least: Replica, work: int, full: frozenset[int] = frozenset()) -> Replica | None:
        """The READY server that holds the longest known prefix of `tokens`, if it is not too far
        past `least` in load (under the lock)."""
        if self.prefixes is None or tokens is None:
            return None
        found = self.prefixes.lookup(tokens)
        if found is None:
            return None
        owner = self.replicas[found[0]]
        if owner.state != READY or owner.index in full or owner.in_flight - least.in_flight > AFFINITY_SLACK * work:
            self.affinity_passed += 1
            return None
        self.affinity_requests += 1
        self.affinity_tokens += found[1]
        return owner

    @contextmanager
    def serving(self, work: int, timeout: float, tokens=None) -> Iterator[Replica]:
        """The replica a request of `work` (and prompt `tokens`, for affinity) goes to, counted in
        flight while the block runs."""
        with self._cond:
            replica = self._pick(timeout, work, tokens)
            self._count(replica, work, tokens)
        try:
            yield replica
        finally:
            self.release(replica, work)

    def take(self, work: int, tokens=None, full: frozenset[int] = frozenset()) -> Replica | None:
        """`serving` without waiting, for a coroutine (generation.py): the replica now counted in
        flight (hand it back with release()), or None when no READY server outside `full` (those
        at their bound of requests) can take it; wait for `on_change` then."""
        with self._cond:
            replica = self._choose(work, tokens, full)
            if replica is not None:
                self._count(replica, work, tokens)
            return replica

    def _count(self, replica: Replica, work: int, tokens) -> None:
        replica.in_flight += work
        replica.requests += 1
        self._last = replica.index
        if self.prefixes is not None and tokens is not None:  # its siblings in flight find it
            self.prefixes.record(tokens, replica.index)

    def release(self, replica: Replica, work: int) -> None:
        with self._cond:
            replica.in_flight -= work

    def add_tokens(self, replica: Replica, tokens: int, sequence=None) -> None:
        """Count `tokens` generated by `replica`; `sequence` (prompt + response) is now in its cache."""
        with self._cond:
            replica.tokens += tokens
            if self.prefixes is not None and sequence is not None and replica.state == READY:
                self.prefixes.record(sequence, replica.index)

    def stats(self) -> dict[str, float]:
        """vllm/server{k}/{requests,tokens,restarts,ready} per server, and with affinity
        vllm/affinity/{requests,matched_tokens} (requests placed on the server of their longest known
        prefix, and the prefix tokens they matched) and vllm/affinity/passed_over (requests whose
        prefix server was passed over: too busy, at its bound of requests, or not ready) (only for a
        pool of 2 or more: the pool totals are the engine's vllm/requests, vllm/restarts)."""
        if len(self.replicas) < 2:
            return {}
        with self._cond:
            out: dict[str, float] = {}
            if self.prefixes is not None:
                out.update({"vllm/affinity/requests": self.affinity_requests,
                            "vllm/affinity/matched_tokens": self.affinity_tokens,
                            "vllm/affinity/passed_over": self.affinity_passed})
            for r in self.replicas:
                p = f"vllm/server{r.index}/"
                out.update({p + "requests": r.requests, p + "tokens": r.tokens, p + "restarts": r.restarts,
                            p + "ready": float(r.state == READY)})
                out.update({p + k: v for k, v in r.extra.items()})
            return out
