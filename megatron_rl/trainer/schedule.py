"""Rollout schedules: WHEN samples are generated and when the engine gets the new weights (how a
batch is made and how weights travel is trainer/rollouts.py's and trainer/transport.py's).

    schedule = SCHEDULES.get(cfg.train.schedule).make(ScheduleInputs(cfg.train, batches, weights))
    rollout = schedule.rollout(step, version)  # this step's samples and rewards: rank 0's, None elsewhere
    ...update...
    version = schedule.after_update(version)   # the trainer's new version; weights pushed if it says so

A schedule is a `Schedule` with a `ScheduleSpec` in SCHEDULES (its factory and its config check);
a new one is a class and one registry line at the end of this file.

`sync` (default)   generate the step's batch from the current weights, update, sync the weights.
                   Off-policy only within the step (train.num_minibatches).
`staged` (K)       µ-GRPO: the run is K stages of train.steps / K steps. A stage's first step
                   generates every batch of the stage in one engine call, from the weights at
                   that moment; its steps then train on them with no weight sync until the next
                   stage. The last step of a stage trains on data steps_per_stage - 1 versions old.
`async` (s)        generation of batch t + s overlaps the update of step t, from the weights of
                   version t: every batch is exactly s versions old when it is trained on (the
                   first s batches come from the initial weights). The embedded engine runs in a
                   background thread on rank 0; the weights are synced after each update, once that
                   generation has finished, so the engine is never written while it samples.

Which log-probs the losses see, in every schedule (docs/algorithms.md, decoupled PPO):
    μ       rollout_logprobs: the engine, with the weights that generated the sample (version v_i)
    π_old   old_logprobs: the trainer, recomputed at the start of the step with the current
            weights θ_t: the proximal policy π_prox of decoupled PPO
    π_θ     the trainer during the update
so w = π_old/μ carries the staleness (t - v_i versions) and the engine mismatch together, and the
clip ratio r = π_θ/π_old stays relative to the proximal policy. Staleness = t - v_i in trainer
versions (RL steps; one version = train.num_minibatches optimizer steps).

Batches generated ahead and not yet trained on are part of the checkpoint (`state_dict`: rank 0
saves them with the checkpoint; tensors only, loaded with weights_only), so a resumed run trains on
exactly the samples the uninterrupted one would have: resume is bit-exact for every schedule.
A batch that was lost (an engine failure in the background) is generated again, synchronously,
from the weights at hand.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from megatron_rl.registry import Registry
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.rollout_io import broadcast, on_rank0
from megatron_rl.trainer.rollouts import Batches, EngineWeights, Rollout, Sampled

__all__ = ["SCHEDULES", "AsyncSchedule", "Schedule", "ScheduleInputs", "ScheduleSpec", "StagedSchedule",
           "SyncSchedule", "staleness"]


class Schedule(Protocol):
    """max_staleness: the most trainer versions a trained-on sample can be behind."""

    max_staleness: int

    def rollout(self, step: int, version: int) -> Rollout | None:
        """Step `step`'s batch on rank 0, None on the other ranks (they get their rows from it as
        tensors: trainer/scatter.py); `version`: the trainer's version now (collective: a failure
        is RolloutFailed on every rank)."""

    def after_update(self, version: int) -> int:
        """The step's update is done: returns the trainer's new version (version + 1), after pushing
        the weights to the engine if the schedule says so (collective)."""

    def ensure_synced(self, version: int) -> None:
        """Push unless the engine already holds `version` (collective): before an evaluation."""

    def stats(self) -> dict[str, int]: ...

    def load_stats(self, stats: dict) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class ScheduleInputs:
    """train: the config's TrainSection; batches / weights: trainer/rollouts.py (rank 0 holds the
    engine; elsewhere they only take part in the collectives)."""

    train: object
    batches: Batches | None
    weights: EngineWeights | None


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """make: ScheduleInputs -> Schedule; check: the schedule's own rules on the TrainSection
    (raise ValueError naming the field), run by config/validate.py."""

    make: Callable[[ScheduleInputs], Schedule]
    check: Callable[[object], None] = lambda train: None


class SyncSchedule:
    """Generate, update, sync: every step."""

    max_staleness = 0

    def __init__(self, batches: Batches | None, weights: EngineWeights | None):
        self.batches, self.weights = batches, weights
        self.pending: dict[int, Rollout] = {}
        self.generate_calls = 0
        self.weight_syncs = 0

    def rollout(self, step: int, version: int) -> Rollout | None:
        return on_rank0(f"at step {step + 1}", lambda: self._take(step), share=False)

    def _take(self, step: int) -> Rollout:
        if step not in self.pending:
            self._generate(self._steps_for(step))
        return self.pending.pop(step)

    def _steps_for(self, step: int) -> list[int]:
        return [step]

    def _generate(self, steps: list[int]) -> None:
        self.generate_calls += 1
        self.pending.update(self.batches.score(self.batches.sample(steps)))

    def after_update(self, version: int) -> int:
        self.sync(version + 1)
        return version + 1

    def sync(self, version: int) -> None:
        """The engine gets the trainer's weights as `version` (collective)."""
        self.weights.push(version)
        self.weight_syncs += 1

    def ensure_synced(self, version: int) -> None:
        """Sync unless the engine already holds `version` (collective): before an evaluation, and at
        a stage's first step. Batches already generated are not affected."""
        if self.weights.engine_version() != version:
            self.sync(version)

    def stats(self) -> dict[str, int]:
        """Counts since the run started (a resumed run's continue the checkpoint's)."""
        return {"schedule/generate_calls": self.generate_calls, "schedule/weight_syncs": self.weight_syncs}

    def load_stats(self, stats: dict) -> None:
        """Continue the counts of `stats()` (names it does not hold stay as they are)."""
        self.generate_calls = stats.get("schedule/generate_calls", self.generate_calls)
        self.weight_syncs = stats.get("schedule/weight_syncs", self.weight_syncs)

    def state_dict(self) -> dict:
        """Rank 0: the batches generated ahead (plain tensors, lists, numbers and strings)."""
        return {"pending": {str(k): _rollout_state(v) for k, v in self.pending.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.pending = {int(k): _rollout_from(v) for k, v in state.get("pending", {}).items()}

    def wait(self) -> None:
        """Until a background generation has finished (the async schedule has one)."""

    def close(self) -> None:
        pass


class StagedSchedule(SyncSchedule):
    """µ-GRPO: K stages; one generation per stage, one weight sync per stage."""

    def __init__(self, batches: Batches | None, weights: EngineWeights | None, stages: int, steps: int):
        super().__init__(batches, weights)
        self.steps_per_stage = steps // stages
        self.max_staleness = self.steps_per_stage - 1

    def _steps_for(self, step: int) -> list[int]:
        end = (step // self.steps_per_stage + 1) * self.steps_per_stage
        return list(range(step, end))

    def rollout(self, step: int, version: int) -> Rollout | None:
        if step % self.steps_per_stage == 0:
            self.ensure_synced(version)  # a new stage samples from the newest weights
        return super().rollout(step, version)

    def after_update(self, version: int) -> int:
        return version + 1  # the engine keeps the stage's weights until the next stage


class AsyncSchedule(SyncSchedule):
    """Batch t + s is sampled in the background while step t trains, from version t; it is scored
    on the main thread once sampling is done (the math reward's time limit needs the main thread)."""

    def __init__(self, batches: Batches | None, weights: EngineWeights | None, max_staleness: int, steps: int):
        super().__init__(batches, weights)
        self.max_staleness, self.steps = max_staleness, steps
        self._worker: threading.Thread | None = None
        self._sampled: Sampled | None = None
        self._error: BaseException | None = None

    def _take(self, step: int) -> Rollout:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        last = min(step + self.max_staleness, self.steps)
        missing = [s for s in range(step, last) if s not in self.pending]
        if missing:  # the first steps (initial weights), or a batch lost to a failure
            self._generate(missing)
        ahead = step + self.max_staleness
        if ahead < self.steps and ahead not in self.pending:
            self.generate_calls += 1
            self._worker = threading.Thread(target=self._background, args=(ahead,), daemon=True,
                                            name="rollout-generation")
            self._worker.start()
        return self.pending.pop(step)

    def _background(self, step: int) -> None:
        try:
            self._sampled = self.batches.sample([step])
        except Exception as e:  # noqa: BLE001 - reported on rank 0's next rollout()
            self._error = e

    def wait(self, timeout: float | None = None) -> None:
        """Until the background sampling (if any) has finished; then score it (main thread)."""
        if self._worker is not None:
            self._worker.join(timeout)
            if self._worker.is_alive():  # only on the way out (close): a daemon thread
                return
            self._worker = None
        if self._sampled is not None:
            sampled, self._sampled = self._sampled, None
            try:
                self.pending.update(self.batches.score(sampled))
            except Exception as e:  # noqa: BLE001 - reported on rank 0's next rollout()
                self._error = e

    def after_update(self, version: int) -> int:
        self.wait()  # the engine must be idle before its weights change
        if broadcast(self._error is not None if self.batches is not None and self.batches.engine is not None
                     else None):
            return version + 1  # the engine failed: the next rollout() reports it on every rank
        return super().after_update(version)

    def close(self) -> None:
        self.wait(timeout=10.0)  # on the way out after an error: do not wait for a long generation


def _check_staged(train) -> None:
    if train.steps % train.stages:
        raise ValueError(f"train.schedule=staged: train.steps={train.steps} is not a multiple of "
                         f"train.stages={train.stages}; every stage has the same number of steps")


SCHEDULES = Registry("schedule", ScheduleSpec)
SCHEDULES.add("sync", ScheduleSpec(lambda i: SyncSchedule(i.batches, i.weights)))
SCHEDULES.add("staged", ScheduleSpec(lambda i: StagedSchedule(i.batches, i.weights, i.train.stages, i.train.steps),
                                     check=_check_staged))
SCHEDULES.add("async", ScheduleSpec(lambda i: AsyncSchedule(i.batches, i.weights, i.train.max_staleness,
                                                            i.train.steps)))


def staleness(batch_versions: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """[N] versions each row was generated with -> [N] int64 staleness t - v_i (>= 0)."""
    return trainer_version - batch_versions.long()


def _rollout_state(r: Rollout) -> dict:
    return {"samples": [dataclasses.asdict(s) for s in r.samples], "rewards": r.rewards,
            "reward_stats": dict(r.reward_stats)}


def _rollout_from(state: dict) -> Rollout:
    # a field the saved samples have and Sample no longer does (the unused `metadata` of older
    # checkpoints) is dropped; one they lack takes its default
    known = {f.name for f in dataclasses.fields(Sample)}
    return Rollout([Sample(**{k: v for k, v in s.items() if k in known}) for s in state["samples"]], state["rewards"],
                   dict(state["reward_stats"]))
