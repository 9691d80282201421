"""The weight-transport seam: how the trainer's weights reach the rollout engine.

    name = WEIGHT_SYNCS.get(weight_sync(cfg.rollout)).transport   # rollout.weight_sync's sender
    transport = TRANSPORTS.get(name).make(TransportInputs(groups, arch, run_dir))
    transport.push(policy, engine, version)     # every rank; the engine holds `version` after it

The config names how weights reach the engine once, `rollout.weight_sync` (rollout/engine.py:
WEIGHT_SYNCS; each entry says which transport here sends it, each engine's spec which names it
takes); the engine implements the receiving protocol of each one's transport (rollout/engine.py:
TakesTensors for memory, TakesDirectory for disk).

    memory   rank 0 streams (HF name, tensor) pairs into the engine object it holds
             (TakesTensors.update_weights), no file: the embedded engine copies them on-device;
             the vLLM engine forwards them to its server's workers in bounded buckets over vLLM's
             weight-transfer API (rollout/vllm/transfer.py; rollout.weight_sync=memory).
    disk     rank 0 writes an HF model folder under <run_dir>/weights (config.json + safetensors,
             atomically) and hands its path over (TakesDirectory.load_weights_from): the vLLM
             server reloads it in place or restarts on it (rollout.weight_sync=reload|restart);
             the engine owns the folder from then on and deletes it when no longer needed.

Both gather the model to global rank 0 only (`export_hf_weights(to=0)`: TP/EP shards within a
stage, then point to point from each other stage to rank 0); no other rank materialises another
stage's tensors.

Every rank iterates the export to its end whatever the engine does (it is collective), and a
failure on rank 0 reaches every rank as RolloutFailed. Cost: the model's bytes once per push
through rank 0 (disk: plus one write and the engine's read); peak memory one tensor beyond the
engine's copy (memory) or one safetensors shard (disk).
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_rl.model.hf_io import save_hf_checkpoint
from megatron_rl.registry import Registry
from megatron_rl.rollout.engine import TakesDirectory, TakesTensors
from megatron_rl.trainer.rollout_io import RolloutFailed, broadcast

Named = Iterable[tuple[str, torch.Tensor]]


class WeightTransport(Protocol):
    def push(self, policy, engine, version: int) -> None:
        """Give `engine` (on the rank that holds it; None elsewhere) the policy's current weights as
        version `version`. Collective over every rank; raises RolloutFailed on every rank."""


@dataclass(frozen=True)
class TransportInputs:
    """What a transport's factory gets: the process groups, the model's architecture (an HF
    folder's config.json) and the run directory (where a file-based transport writes)."""

    groups: Any
    arch: Any
    run_dir: str


@dataclass(frozen=True)
class TransportSpec:
    """make: TransportInputs -> WeightTransport."""

    make: Callable[[TransportInputs], WeightTransport]

    def __post_init__(self):
        if not callable(self.make):
            raise TypeError(f"TransportSpec.make must be a factory TransportInputs -> WeightTransport, got {self.make!r}")


TRANSPORTS = Registry("weight transport", TransportSpec)


def _push(policy, engine, version: int, deliver: Callable[[Named], None]) -> None:
    """Export to rank 0 and hand the stream to `deliver` there; every rank drains its part and
    learns of a failure on rank 0."""
    named = policy.export(to=0)
    error = None
    if engine is not None:
        try:
            deliver(named)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = RolloutFailed(f"rollout engine failed to load weights version {version}: {type(e).__name__}: {e}")
    for _ in named:  # keep step with the other ranks' gathers (all of them when the engine stopped reading)
        pass
    error = broadcast(error)
    if error is not None:
        raise error


class MemoryTransport:
    """Rank 0 streams the tensors into the engine object it holds."""

    def __init__(self, inputs: TransportInputs):
        del inputs

    def push(self, policy, engine: TakesTensors | None, version: int) -> None:
        _push(policy, engine, version, lambda named: engine.update_weights(named, version))


class DiskTransport:
    """Rank 0 writes an HF model folder per push and hands its path to the engine."""

    def __init__(self, inputs: TransportInputs):
        self.root, self.arch = os.path.join(inputs.run_dir, "weights"), inputs.arch
        self.tag = uuid.uuid4().hex[:8]  # two runs sharing a run_dir never write the same folder
        self.written = 0

    def write(self, named: Named, version: int) -> str:
        """One complete model folder (config.json + safetensors, atomic); its path."""
        self.written += 1
        path = os.path.join(self.root, f"{self.tag}-{self.written:05d}-v{version}")
        save_hf_checkpoint(path, self.arch, named)
        return path

    def push(self, policy, engine: TakesDirectory | None, version: int) -> None:
        _push(policy, engine, version, lambda named: engine.load_weights_from(self.write(named, version), version))


TRANSPORTS.add("memory", TransportSpec(MemoryTransport))
TRANSPORTS.add("disk", TransportSpec(DiskTransport))

