"""What the serving layer needs of a server kind's weight receivers: the kind's own code (vLLM's:
rollout/vllm/transfer.py, weight_sync.py), handed in by its dialect (memory_receiver, disk_receiver)
and its engine (the in-memory `Push`), so the layer names none of it. Also the weight folders an
engine keeps (WeightDirs).

    replica = Replica(k, server, dialect.memory_receiver(server, backend, bucket_bytes, host))   # Receiver
    replica.memory.open(startup_timeout_s, sync_timeout_s)      # fleet.py: after each (re)start
    pushed = push([r.memory for r in replicas], named, version, timeout, held=..., watch=Watch(...))
    timings = dialect.disk_receiver("reload").apply(server, model_dir, timeout, warmup)   # DiskReceiver
    replica.memory.close()                                      # fleet.py: at close

Cost: none (protocols); WeightDirs holds `keep` folder names and deletes the older folders.
"""
from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_rl.rollout.serving.handle import ServerHandle


class Receiver(Protocol):
    """One server's in-memory weight receiver (weight_sync=memory): a connection to that server
    process over which the engine's push streams tensors (vLLM's: transfer.MemorySync, one
    weight-transfer group per server). Held by the pool's replica (pool.py, `Replica.memory`)."""

    def open(self, timeout: float, group_timeout: float | None = None) -> None:
        """Once per server process, after it started (a restart opens anew): the rendezvous.
        `timeout`: of its requests; `group_timeout`: of the connection's collective calls."""
        ...

    def close(self) -> None:
        """Let go of the connection (the server may be gone)."""
        ...


class DiskReceiver(Protocol):
    """Make a running server serve the weights in an HF folder (weight_sync=reload, restart; vLLM's:
    weight_sync.DiskReloadSync, RestartSync)."""

    def apply(self, server: ServerHandle, model_dir: str, timeout: float,
              warmup: Callable[[], None]) -> dict[str, float]:
        """The timings it measured (seconds, `timing/...`; `timing/vllm_restart` when it started a new
        server process). Transport failures propagate (the engine restarts); `warmup` is the engine's
        first-request check, for a receiver that starts a new server process."""
        ...


@dataclass
class Pushed:
    """What a push did: seconds it took, and the servers dropped on the way (their receiver -> why)."""

    seconds: float
    failed: dict[Receiver, str]


@dataclass
class Watch:
    """How a push watches the servers: the whole push must end within `deadline_s` (the
    setting's name goes in the error); while it waits on a server, `alive(receiver)` is asked every
    `interval_s` seconds (None: never)."""

    deadline_s: float = math.inf
    setting: str = "the sync's deadline"
    alive: Callable[[Receiver], bool] | None = None
    interval_s: float = 5.0
    health_setting: str = "the health check"


class Push(Protocol):
    """The in-memory sync of the engine's kind (vLLM's: transfer.push_all): stream `named` (HF
    checkpoint-format (name, tensor) pairs) into every receiver as weights `version`. `held`: those
    already paused by the generation (a partial rollout), which stay so. A server that fails, dies
    or runs past `watch` is dropped and named in Pushed.failed, left half updated; an error of the
    stream itself propagates."""

    def __call__(self, receivers: list[Receiver], named: Iterable[tuple[str, torch.Tensor]], version: int,
                 timeout: float, held: Collection[Receiver] = (), watch: Watch | None = None) -> Pushed: ...


class WeightDirs:
    """The weight folders an engine was given, oldest first; all but the newest `keep` are deleted."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.dirs: list[str] = []

    @property
    def latest(self) -> str | None:
        return self.dirs[-1] if self.dirs else None

    def add(self, path: str) -> None:
        self.dirs.append(path)

    def prune(self) -> None:
        while len(self.dirs) > self.keep:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def clear(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs = []
