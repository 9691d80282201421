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
                   generation has finished, so the engine is never written while it samples
                   (train.in_flight_update=wait).
  partial rollouts (train.in_flight_update=pause): the push parks the generation at the engine's
                   next decode step instead, loads the weights and lets it go on: the tokens after
                   the split come from version t + 1 (Sample.token_versions), and staleness is
                   counted per token (s or s - 1). `abort` drops the generation and samples the
                   batch again from version t + 1 (s - 1 versions old). Where the split falls
                   depends on timing, so two such runs differ; a resume still trains on exactly
                   the saved batches (the one in flight is finished and saved with its versions).

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
from megatron_rl.rollout.pausing import GenerationAborted
from megatron_rl.rollout.types import Sample
from megatron_rl.trainer.rollout_io import broadcast, on_rank0
from megatron_rl.trainer.rollouts import Batches, EngineWeights, Rollout, Sampled

__all__ = ["SCHEDULES", "AsyncSchedule", "Schedule", "ScheduleInputs", "ScheduleSpec", "StagedSchedule",
           "SyncSchedule", "staleness", "token_staleness"]


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
    (raise ValueError naming the field), run by configure/rules.py."""

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
    on the main thread once sampling is done (the math reward's time limit needs the main thread).

    in_flight: what the weight push after step t's update does to that generation (train.
    in_flight_update): "wait" for it to finish; "pause" it at the engine's next decode step, push,
    resume (partial rollouts: its later tokens come from version t + 1); "abort" it, push, and
    generate the batch again from version t + 1. The generation of batch t + s starts at step t's
    rollout() and is finished by step t + 1's, so at most one push falls inside it: a token of
    it is s (before the push) or s - 1 (after) versions old when trained on, never more than s."""

    def __init__(self, batches: Batches | None, weights: EngineWeights | None, max_staleness: int, steps: int,
                 in_flight: str = "wait"):
        super().__init__(batches, weights)
        self.max_staleness, self.steps, self.in_flight = max_staleness, steps, in_flight
        self._worker: threading.Thread | None = None
        self._worker_step: int | None = None
        self._sampled: Sampled | None = None
        self._error: BaseException | None = None
        self._aborted = False

    def _take(self, step: int) -> Rollout:
        self.wait()  # pause / abort: the generation a push did not wait for
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        last = min(step + self.max_staleness, self.steps)
        missing = [s for s in range(step, last) if s not in self.pending]
        if missing:  # the first steps (initial weights), or a batch lost to a failure
            self._generate(missing)
        ahead = step + self.max_staleness
        if ahead < self.steps and ahead not in self.pending:
            self._launch(ahead)
        return self.pending.pop(step)

    def _launch(self, step: int) -> None:
        self.generate_calls += 1
        self._worker_step = step
        self._worker = threading.Thread(target=self._background, args=(step,), daemon=True, name="rollout-generation")
        self._worker.start()

    def _background(self, step: int) -> None:
        try:
            self._sampled = self.batches.sample([step])
        except GenerationAborted:  # in_flight=abort: generated again once the new weights are in
            self._aborted = True
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
        if self.in_flight == "wait":
            self.wait()  # the engine must be idle before its weights change
        if broadcast(self._error is not None if self.batches is not None and self.batches.engine is not None
                     else None):
            return version + 1  # the engine failed: the next rollout() reports it on every rank
        return super().after_update(version)

    def sync(self, version: int) -> None:
        """Push `version` (collective); on rank 0, a generation in flight is first parked (pause)
        or ended (abort) per `in_flight`, and goes on (is started again) after the push. When the
        push fails, a parked generation is ended (engine.abort()), never resumed, and the error
        propagates (the run stops)."""
        engine = self.batches.engine if self.batches is not None else None
        held = self.in_flight != "wait" and engine is not None and self._worker is not None
        if held:
            (engine.abort if self.in_flight == "abort" else engine.pause)()
        try:
            super().sync(version)
        except BaseException:
            if held and self.in_flight == "pause":
                # a failed push leaves the engine's weights half loaded: the parked generation
                # must not go on over them (on a vLLM server its engine core dies); ended instead
                engine.abort()
            raise
        finally:
            if held:
                engine.resume()
        if held and self.in_flight == "abort":
            self._worker.join()  # it has left the engine (abort returned): only the thread's end
            self._worker = None
            if self._aborted:
                self._aborted = False
                self._launch(self._worker_step)

    def ensure_synced(self, version: int) -> None:
        self.wait()  # an evaluation uses the engine: the background generation finishes first
        super().ensure_synced(version)

    def state_dict(self) -> dict:
        """The batches generated ahead, the one in flight included once it has finished (pause /
        abort: a push did not wait for it), with their per-token versions."""
        self.wait()
        return super().state_dict()

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
                                                            i.train.steps, i.train.in_flight_update)))


def staleness(row_versions: torch.Tensor, trainer_version: int, token_versions: torch.Tensor | None = None,
              length: int = 1) -> torch.Tensor:
    """Per-token staleness t - v_{i,k} (>= 0), [N, length] int64: from token_versions [N, length]
    (a batch with partial rollouts: trainer/batch.py) or, when None, each row's version
    row_versions [N] for all its tokens."""
    if token_versions is not None:
        return trainer_version - token_versions.long()
    return (trainer_version - row_versions.long())[:, None].expand(-1, length)


def token_staleness(batch, trainer_version: int) -> tuple[float, float]:
    """(token-weighted mean, max) of `staleness` over the trained tokens of a packed batch (a
    TrainBatch: loss_mask [N, L], versions [N], token_versions [N, L] or None); (0, 0) when it has
    none. A sample that crossed a weight update counts each token at its own version. Cost: O(N·L)
    on the batch's device (the trainer's batch is on the host then), two scalars read back."""
    stale = staleness(batch.versions, trainer_version, batch.token_versions, batch.loss_mask.shape[1])
    stale = stale[batch.loss_mask]
    if not stale.numel():
        return 0.0, 0.0
    return int(stale.sum()) / stale.numel(), float(stale.max())


def _rollout_state(r: Rollout) -> dict:
    return {"samples": [dataclasses.asdict(s) for s in r.samples], "rewards": r.rewards,
            "reward_stats": dict(r.reward_stats)}


def _rollout_from(state: dict) -> Rollout:
    # a field the saved samples have and Sample no longer does (the unused `metadata` of older
    # checkpoints) is dropped; one they lack takes its default
    known = {f.name for f in dataclasses.fields(Sample)}
    return Rollout([Sample(**{k: v for k, v in s.items() if k in known}) for s in state["samples"]], state["rewards"],
                   dict(state["reward_stats"]))
