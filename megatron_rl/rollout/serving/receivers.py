"""What the serving layer needs of a server kind's weight receivers: the kind's own code (vLLM's:
rollout/vllm/transfer.py, weight_sync.py), handed in by its dialect (memory_receiver, disk_receiver)
and its engine (the in-memory push), so the layer names none of it.

    replica = Replica(k, server, dialect.memory_receiver(server, backend, bucket_bytes, host))   # Receiver
    replica.memory.open(startup_timeout_s, sync_timeout_s)      # fleet.py: after each (re)start
    replica.memory.close()                                      # fleet.py: at close

Cost: none (protocols).
"""
from __future__ import annotations

from typing import Protocol


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
