"""The rollout engine seam: the `RolloutEngine` protocol and the `ENGINES` registry.

    spec = ENGINES.get(cfg.rollout.backend)              # "embedded", "vllm", or a registered one
    limit = spec.max_len(cfg.rollout, arch)              # before the engine exists (prompt checks)
    engine = spec.make(EngineRequest(arch, cfg.rollout, run_dir, needs=EngineNeeds.of(cfg)))
    transport.push(policy, engine, version)              # weights in (trainer/transport.py)
    groups = engine.generate(prompt_ids, n=8, sampling=params)    # token ids in, Samples out
    samples = engine.generate_requests([Request(ids, params, stream=(k, 0)), ...])   # one each
    engine.stats()                                       # counters the trainer logs as they are

An engine is an object with the protocol's members; an `EngineSpec` says how to build one from
the config and what it can do, so the trainer and the config check handle every engine alike:

    make              EngineRequest -> RolloutEngine (runs on the rank that holds the engine)
    settings          its typed config section, `rollout.<name>` (e.g. VllmConfig), or None;
                      registering the engine registers the section with the config
                      (config/engine_sections.py), which also says what a section may declare
                      (secrets, `check_on_this_machine`)
    max_len           (rollout section, arch) -> the longest prompt + response it takes
    no_routing        (rollout section) -> why, as configured, its samples cannot carry routed
                      experts (router replay R3), or None (they can, or it is known only once
                      the engine finds its server, which then refuses)
    no_fp32_lm_head   why it cannot run the LM head alone in fp32 (precision.fp32_lm_head), or None
    quantizations     the FP8 formats it runs for rollout.quantization (precision/fp8.py); () = none
    weight_syncs      the weight syncs it takes (rollout.weight_sync, names in WEIGHT_SYNCS below),
                      first = its default ("auto"); it implements the receiver protocol of each
                      one's transport (TakesTensors for memory, TakesDirectory for disk)
    may_change        fields of its section a resume may change (where it runs, how it is reached)
    in_flight_updates the train.in_flight_update modes it supports: "wait" always; "pause" and
                      "abort" when it implements `Pausable` (pause: parks its generation at a
                      step boundary and reports each token's version; abort: ends it)
    no_in_flight      (rollout section, mode) -> why, as configured, it cannot take a mode it
                      lists (vLLM: pause with rollout.weight_sync=restart), or None
    check             (rollout section) -> None: its section's rules that read a registry (vLLM:
                      rollout.vllm.dialect names a registered server kind); raises ValueError
                      naming the field, the registered names and the fix; None = no such rule

How weights reach an engine is one name, `rollout.weight_sync`, in one registry, WEIGHT_SYNCS
(rollout/registered.py adds each): its `WeightSyncSpec` says which trainer transport sends it
(trainer/transport.py: memory or disk); the engine's spec says which names it takes:

    sync = weight_sync(cfg.rollout)                  # "auto" resolved to the engine's default
    WEIGHT_SYNCS.get(sync).transport                 # "memory" | "disk": what the trainer sends

What the trainer needs from any engine is stated once, in engine terms (`EngineNeeds`: kept
top-p/top-k sets, routed experts, an fp32 head), never by the engine reading the loss or MoE
sections. Adding an engine: a module with the class and its `EngineSpec`, and one line in
rollout/registered.py (docs/architecture.md).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from megatron_rl.config.engine_sections import register_engine_section, unregister_engine_section
from megatron_rl.registry import Registry
from megatron_rl.rollout.types import Request, Sample, SamplingParams

if TYPE_CHECKING:
    from megatron_rl.model.arch import ModelArch


class RolloutEngine(Protocol):
    """A backend that samples responses; it receives weights through the receiver protocol of each
    transport its spec lists (TakesTensors, TakesDirectory below).

    policy_version: the trainer version of the weights it holds (-1 before the first).
    max_len: the longest prompt + response it takes, in tokens.
    """

    policy_version: int

    @property
    def max_len(self) -> int: ...

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Sample]]:
        """n samples for each prompt (token ids in, token ids out); result[i][j] is sample j of prompt i:
        the samples of generate_requests(requests_of(prompts, n, sampling)) (rollout/types.py)."""

    def generate_requests(self, requests: Sequence[Request]) -> list[Sample]:
        """One sample per request, in order; requests may differ in prompt and sampling settings,
        each draws from its own stream (Request.stream). The engine batches them as it sees fit;
        rollout/requests.py hands it whatever requests are pending."""

    def stats(self) -> dict[str, float]:
        """Counters and timings since construction (namespaced: `vllm/restarts`); {} when none."""

    def close(self) -> None:
        """Release the backend (stop servers, free memory)."""


# How an engine receives weights: one protocol per weight transport (trainer/transport.py). An
# engine implements those of the transports of the weight syncs its spec lists.
class TakesTensors(Protocol):
    """The `memory` transport's receiver: an engine in the trainer's process."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load HF checkpoint-format (name, tensor) pairs, streamed; set policy_version."""


class TakesDirectory(Protocol):
    """The `disk` transport's receiver: an engine that reads an HF model folder."""

    def load_weights_from(self, model_dir: str, version: int) -> None:
        """Serve the weights in `model_dir` (config.json + safetensors); set policy_version. The
        engine owns the folder from then on and deletes it once it no longer needs it."""


@runtime_checkable
class Serves(Protocol):
    """An engine that batches continuously: requests join its running batch at decode-step boundaries
    (rollout/requests.py hands them over as they come; rollout/decoding.py's Inbox)."""

    def serve(self, inbox) -> None:
        """Decode what `inbox` holds, delivering each sample as its sequence ends, until the inbox is
        closed and empty."""


@runtime_checkable
class SamplesEach(Protocol):
    """An engine whose requests are coroutines of their own (the vLLM engine: one HTTP request each,
    rollout/serving/generation.py): rollout/requests.py awaits each request as it comes, and a sample
    comes back as soon as its answer does, whatever else is in flight."""

    async def sample(self, request: Request) -> Sample:
        """The sample of `request`, awaited from any event loop (cancelling the await cancels the
        request)."""


class Pausable(Protocol):
    """An engine whose generation can be parked mid-way for a weight update (partial rollouts,
    train.in_flight_update=pause|abort; rollout/pausing.py). Called from the trainer's thread while
    another thread generates."""

    def pause(self) -> None:
        """Return once the generation in flight is parked (at once when none runs); none starts
        until resume()."""

    def abort(self) -> None:
        """Make the generation in flight raise GenerationAborted; return once it has ended."""

    def resume(self) -> None:
        """Let the parked generation go on (its later tokens carry the version it holds now)."""


@dataclass(frozen=True)
class EngineNeeds:
    """What the trainer needs from the engine's samples, derived from the run config once.

    kept_sets: the kept top-p/top-k token set of every sampled token and log-probs renormalised
        over it (loss.keep_sampling_mask).
    routed_experts: the routed experts of every position (moe.router_replay=r3).
    fp32_lm_head: the LM head and its softmax in fp32 (precision.fp32_lm_head).
    """

    kept_sets: bool = False
    routed_experts: bool = False
    fp32_lm_head: bool = False

    @classmethod
    def of(cls, cfg) -> EngineNeeds:
        """From a RunConfig."""
        return cls(kept_sets=cfg.loss.keep_sampling_mask, routed_experts=cfg.moe.router_replay == "r3",
                   fp32_lm_head=cfg.precision.fp32_lm_head)


@dataclass(frozen=True)
class EngineRequest:
    """What an engine factory gets. rollout: the config's rollout section (sampling settings, the
    engine's own typed section); run_dir: where it may keep files (server logs); device: the
    trainer's device (an in-process engine's default placement); stopping: the trainer's stop flag
    (an engine does not restart a dead server once it is set)."""

    arch: ModelArch
    rollout: Any  # config.schema.RolloutSection (typed loosely: the config package imports this one)
    run_dir: str
    needs: EngineNeeds = EngineNeeds()
    device: str = "cpu"
    stopping: Callable[[], bool] = lambda: False


def model_len(rollout, arch: ModelArch) -> int:
    """The model's own limit (an engine with no limit of its own)."""
    return arch.max_position_embeddings


def routes(rollout) -> str | None:
    """An engine that reports routed experts (None: no reason it cannot)."""
    return None


@dataclass(frozen=True)
class WeightSyncSpec:
    """A way the trainer's weights reach an engine, `rollout.weight_sync=<name>` (module docstring).

    transport: the trainer's side of it, a name in trainer/transport.py's TRANSPORTS: "memory"
        (rank 0 streams the tensors to the engine: TakesTensors; per sync one bucketed stream,
        O(bucket) extra memory) or "disk" (rank 0 writes an HF folder per sync and hands its path
        over: TakesDirectory; per sync a full HF folder on disk per version).
    What the engine then does with it is the engine's (the RolloutSection docstring lists the
    built-in names, which engine takes each and what each costs).
    """

    transport: str

    def __post_init__(self):
        if not isinstance(self.transport, str) or not self.transport:
            raise TypeError(f"WeightSyncSpec.transport: name a weight transport (memory, disk), got {self.transport!r}")


WEIGHT_SYNCS = Registry("weight sync", WeightSyncSpec)
AUTO = "auto"  # rollout.weight_sync's default: the engine's first


@dataclass(frozen=True)
class EngineSpec:
    """A registered engine (see the module docstring)."""

    make: Callable[[EngineRequest], RolloutEngine]
    settings: type | None = None
    max_len: Callable[[Any, ModelArch], int] = model_len
    no_routing: Callable[[Any], str | None] = routes
    no_fp32_lm_head: str | None = None
    quantizations: tuple[str, ...] = ()
    weight_syncs: tuple[str, ...] = ("memory",)
    may_change: tuple[str, ...] = ()
    in_flight_updates: tuple[str, ...] = ("wait",)
    no_in_flight: Callable[[Any, str], str | None] | None = None
    check: Callable[[Any], None] | None = None

    def __post_init__(self):
        if not callable(self.make):
            raise TypeError(f"EngineSpec.make must be a factory EngineRequest -> RolloutEngine, got {self.make!r}")
        if not self.weight_syncs or not all(isinstance(t, str) and t != AUTO for t in self.weight_syncs):
            raise TypeError(f"EngineSpec.weight_syncs: name the weight syncs it takes (WEIGHT_SYNCS), got "
                            f"{self.weight_syncs!r}")
        if self.may_change and self.settings is None:
            raise TypeError("EngineSpec.may_change names fields of a settings section, and the engine has none")
        if self.settings is not None:
            known = {f.name for f in fields(self.settings)}
            unknown = sorted(set(self.may_change) - known)
            if unknown:
                raise TypeError(f"EngineSpec.may_change: {unknown} are not fields of {self.settings.__name__}")

    def weight_sync(self, name: str | None) -> str:
        """The weight sync `rollout.weight_sync=name` means for this engine: its default for "auto"
        (or null), else the name (configure/rules.py refuses one it does not take)."""
        return self.weight_syncs[0] if name in (None, AUTO) else name


class EngineRegistry(Registry[EngineSpec]):
    """`ENGINES`: registering an engine also registers its settings section with the config, so
    `rollout.<name>.*` exists exactly for the registered engines."""

    def add(self, name: str, entry: EngineSpec) -> EngineSpec:
        super().add(name, entry)
        if entry.settings is not None:
            try:
                register_engine_section(name, entry.settings)
            except (TypeError, ValueError):
                super().remove(name)
                raise
        return entry

    def remove(self, name: str) -> None:
        super().remove(name)
        unregister_engine_section(name)


ENGINES = EngineRegistry("rollout engine", EngineSpec)


def weight_sync(rollout) -> str:
    """The weight sync of a rollout section (a RolloutSection): rollout.weight_sync, with "auto"
    resolved to its engine's (rollout.backend's) default."""
    return ENGINES.get(rollout.backend).weight_sync(rollout.weight_sync)
