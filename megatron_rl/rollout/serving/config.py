"""ServingConfig: the settings the serving layer reads (launch, health, pool, failover, restart,
probe, generation, update order), one frozen dataclass built by the engine from its own config
section (vLLM's: VllmConfig.serving(), rollout/vllm/config.py). The layer reads no engine's config.

    cfg = ServingConfig(section="rollout.vllm", num_servers=2, request_timeout_s=300.0)
    fleet = Fleet(arch, cfg, root, pool, stopping, dialect)

Each field has the meaning of the engine section's field of the same name (docs/config.md,
rollout.vllm.*), and an error names it as `<section>.<field>`.

Cost: none; a handful of numbers, built once per engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ServingConfig:
    """What the serving layer reads of the engine's settings (module docstring)."""

    section: str
    """Where these settings live in the run config: messages name a field as `<section>.<field>`."""
    urls: tuple[str, ...] = ()
    """Servers run by someone else, one per URL (never restarted by us); empty: launch num_servers."""
    api_key: str | None = field(default=None, repr=False)
    """The bearer key sent to the servers at `urls` (a launched server gets a fresh one of its own)."""
    num_servers: int = 1
    """How many servers to launch when no URL is given."""
    dtype: str = "auto"
    """The servers' dtype (the engine's name of it; "auto": the checkpoint's, fp32 for a config-only start)."""
    routed_experts: bool = False
    """The servers return each token's routed experts (router replay R3): checked after each start."""
    warmup: bool = True
    """One short request after each start, before the server is READY."""
    startup_timeout_s: float = 600.0
    """Seconds a start may take until healthy (also the warm-up's deadline, and the wait for a server
    to come back when none is ready)."""
    health_timeout_s: float = 10.0
    """Seconds one health check may take."""
    health_interval_s: float = 5.0
    """Seconds between the health checks of the servers with requests in flight (and during a sync)."""
    request_timeout_s: float = 600.0
    """Seconds one request may take, connect to last byte (generate, control, probe, load calls)."""
    sync_timeout_s: float = 300.0
    """Seconds a whole in-memory sync may take (and a receiver's rendezvous)."""
    max_concurrency: int = 64
    """Requests of this engine in flight per server."""
    max_retries: int = 3
    """Retries per request of a bad answer, an HTTP 5xx or a dropped connection."""
    retry_backoff_s: float = 0.5
    """The first retry's wait; it doubles with each retry."""
    max_restarts: int = 2
    """Server restarts while requests run without a break (all servers together), and per disk sync."""
    keep_weight_dirs: int = 2
    """The newest weight folders kept (a restart starts on the newest)."""
    probe_every: int = 1
    """The parity probe after every probe_every-th weight sync (the first too); 0: never."""
    probe_tokens: int = 16
    """Tokens the probe scores."""
    probe_tolerance: float = 1e-3
    """The largest |server - reference| log-prob difference the probe passes (resolved for the dtype: the
    engine's default is 1e-3 in float32, 0.1 otherwise)."""
