"""What a run holds: `RunContext` (its parts, each typed by the protocol it is used through) and
`RunState` (what it carries across a resume, in every checkpoint's host state).

The parts meet the outside world at the seams (docs/architecture.md): the rollout engine
(rollout/engine.py), the rollout function (rollout/function.py), the weight transport
(trainer/transport.py) and the schedule (trainer/schedule.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Any

from megatron_rl.config import RunConfig
from megatron_rl.data.types import PromptSource, Tokenizer
from megatron_rl.losses.setup import ResolvedLoss
from megatron_rl.metrics.sink import MetricsSink
from megatron_rl.parallel import ParallelGroups
from megatron_rl.rewards import RewardRunner
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.function import RolloutFn
from megatron_rl.trainer.policy import Policy
from megatron_rl.trainer.replay import Replay
from megatron_rl.trainer.schedule import Schedule
from megatron_rl.trainer.stop import StopSignals
from megatron_rl.trainer.transport import WeightTransport


@dataclass
class RunState:
    """Carried across a resume (the checkpoint's host state `state`, trainer/host_state.py checks it).

    curve: one point per completed RL step (reward, KL, evaluations, loss);
    before_rl_accuracy / before_rl_sampled_accuracy: the held-out accuracies before RL;
    sft: the SFT warm start's summary; nonfinite_in_a_row: skipped non-finite updates in a row."""

    curve: list[dict[str, float]] = field(default_factory=list)
    before_rl_accuracy: float | None = None
    before_rl_sampled_accuracy: float | None = None
    sft: dict[str, Any] | None = None
    nonfinite_in_a_row: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"curve": self.curve, "before_rl_accuracy": self.before_rl_accuracy,
                "before_rl_sampled_accuracy": self.before_rl_sampled_accuracy, "sft": self.sft,
                "nonfinite_in_a_row": self.nonfinite_in_a_row}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RunState:
        """A checkpoint's `state` (one written before a field existed has that field's default)."""
        return cls(curve=list(state.get("curve", [])), before_rl_accuracy=state.get("before_rl_accuracy"),
                   before_rl_sampled_accuracy=state.get("before_rl_sampled_accuracy"), sft=state.get("sft"),
                   nonfinite_in_a_row=int(state.get("nonfinite_in_a_row", 0)))


@dataclass
class RunContext:
    """engine: on global rank 0 only (None elsewhere); policy_version: the trainer's version (RL
    steps applied); run_id: names this run's checkpoints (retention never touches another run's);
    resuming: a checkpoint to resume from exists; run_dir_lock: rank 0's open, flock'ed
    run_dir/.lock (trainer/run_dir.py), held until close."""

    cfg: RunConfig
    groups: ParallelGroups
    tokenizer: Tokenizer
    prompts: PromptSource
    rewards: RewardRunner
    policy: Policy
    engine: RolloutEngine | None
    sink: MetricsSink
    loss: ResolvedLoss
    rollout_fn: RolloutFn
    transport: WeightTransport
    replay: Replay
    schedule: Schedule
    stop: StopSignals = field(default_factory=StopSignals)
    policy_version: int = 0
    run_id: str = ""
    resuming: bool = False
    state: RunState = field(default_factory=RunState)
    run_dir_lock: IO | None = None
