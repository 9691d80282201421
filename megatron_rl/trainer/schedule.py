"""Rollout schedules: when samples are generated, and when the engine gets the new weights.

    schedule = make_schedule(cfg)
    rollout = schedule.rollout(ctx, step)     # this step's samples and rewards, on every rank
    ...update...
    schedule.after_update(ctx)                # the trainer's version + 1; weight sync if the schedule says so

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

import torch

from megatron_rl.rollout.function import Generated
from megatron_rl.rollout.types import Sample, SamplingParams
from megatron_rl.trainer.rollout_io import RolloutFailed, broadcast, on_rank0

__all__ = ["SCHEDULES", "AsyncSchedule", "Rollout", "RolloutFailed", "StagedSchedule", "SyncSchedule", "make_schedule",
           "staleness"]
SCHEDULES = ("sync", "staged", "async")


@dataclasses.dataclass
class Rollout:
    """samples: B*G, groups contiguous; rewards: [B*G] float32 (CPU); reward_stats: host floats."""

    samples: list[Sample]
    rewards: torch.Tensor
    reward_stats: dict


def sampling_for(cfg, tokenizer, step: int) -> SamplingParams:
    r, keep = cfg.rollout, cfg.loss.keep_sampling_mask
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                          stop_token_ids=tokenizer.stop_ids, seed=cfg.train.seed * 1_000_003 + step,
                          return_kept_ids=keep, logprobs_mode="processed" if keep else "raw")


@dataclasses.dataclass
class Sampled:
    """Rank 0: the rollout function's samples of `steps` (one engine call), not yet scored."""

    steps: list[int]
    generated: Generated


def sample_batches(ctx, steps: list[int]) -> Sampled:
    """Rank 0: the batches of `steps` from ONE call of the run's rollout function with the engine's
    current weights (sampling seeded by the first step)."""
    cfg = ctx.cfg
    examples = [e for step in steps for e in ctx.prompts.batch(step, cfg.rollout.prompts_per_step)]
    return Sampled(steps, ctx.rollout_fn(ctx.engine, examples, cfg.rollout.group_size,
                                         sampling_for(cfg, ctx.tokenizer, steps[0])))


def score_batches(ctx, sampled: Sampled) -> dict[int, Rollout]:
    """Rank 0, main thread: rewards, split back per step."""
    cfg = ctx.cfg
    samples, rewards = sampled.generated.samples, sampled.generated.score()
    stats = ctx.rewards.stats()
    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    return {step: Rollout(samples[i * n:(i + 1) * n],
                          torch.tensor(rewards[i * n:(i + 1) * n], dtype=torch.float32), stats if i == 0 else {})
            for i, step in enumerate(sampled.steps)}


class SyncSchedule:
    """Generate, update, sync: every step."""

    name = "sync"
    max_staleness = 0

    def __init__(self):
        self.pending: dict[int, Rollout] = {}
        self.generate_calls = 0
        self.weight_syncs = 0

    def rollout(self, ctx, step: int) -> Rollout:
        return on_rank0(f"at step {step + 1}", lambda: self._take(ctx, step))

    def _take(self, ctx, step: int) -> Rollout:
        if step not in self.pending:
            self._generate(ctx, self._steps_for(step))
        return self.pending.pop(step)

    def _steps_for(self, step: int) -> list[int]:
        return [step]

    def _generate(self, ctx, steps: list[int]) -> None:
        self.generate_calls += 1
        self.pending.update(score_batches(ctx, sample_batches(ctx, steps)))

    def after_update(self, ctx) -> None:
        ctx.policy_version += 1
        self.sync(ctx)

    def sync(self, ctx) -> None:
        """The engine gets the trainer's weights as version ctx.policy_version (collective)."""
        ctx.transport.push(ctx.policy, ctx.engine, ctx.policy_version)
        self.weight_syncs += 1

    def ensure_synced(self, ctx) -> None:
        """Sync unless the engine already holds the trainer's version (collective): before an
        evaluation, and at a stage's first step. Batches already generated are not affected."""
        engine_version = broadcast(ctx.engine.policy_version if ctx.engine is not None else None)
        if engine_version != ctx.policy_version:
            self.sync(ctx)

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

    name = "staged"

    def __init__(self, stages: int, steps: int):
        super().__init__()
        self.steps_per_stage = steps // stages
        self.max_staleness = self.steps_per_stage - 1

    def _steps_for(self, step: int) -> list[int]:
        end = (step // self.steps_per_stage + 1) * self.steps_per_stage
        return list(range(step, end))

    def rollout(self, ctx, step: int) -> Rollout:
        if step % self.steps_per_stage == 0:
            self.ensure_synced(ctx)  # a new stage samples from the newest weights
        return super().rollout(ctx, step)

    def after_update(self, ctx) -> None:
        ctx.policy_version += 1  # the engine keeps the stage's weights until the next stage


class AsyncSchedule(SyncSchedule):
    """Batch t + s is sampled in the background while step t trains, from version t; it is scored
    on the main thread once sampling is done (the math reward's time limit needs the main thread)."""

    name = "async"

    def __init__(self, max_staleness: int):
        super().__init__()
        self.max_staleness = max_staleness
        self._worker: threading.Thread | None = None
        self._ctx = None
        self._sampled: Sampled | None = None
        self._error: BaseException | None = None

    def _take(self, ctx, step: int) -> Rollout:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        last = min(step + self.max_staleness, ctx.cfg.train.steps)
        missing = [s for s in range(step, last) if s not in self.pending]
        if missing:  # the first steps (initial weights), or a batch lost to a failure
            self._generate(ctx, missing)
        ahead = step + self.max_staleness
        if ahead < ctx.cfg.train.steps and ahead not in self.pending:
            self.generate_calls += 1
            self._ctx = ctx  # scored with it in wait()
            self._worker = threading.Thread(target=self._background, args=(ctx, ahead), daemon=True,
                                            name="rollout-generation")
            self._worker.start()
        return self.pending.pop(step)

    def _background(self, ctx, step: int) -> None:
        try:
            self._sampled = sample_batches(ctx, [step])
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
                self.pending.update(score_batches(self._ctx, sampled))
            except Exception as e:  # noqa: BLE001 - reported on rank 0's next rollout()
                self._error = e

    def after_update(self, ctx) -> None:
        self.wait()  # the engine must be idle before its weights change
        ctx.policy_version += 1
        if broadcast(self._error is not None if ctx.engine is not None else None):
            return  # the engine failed: the next rollout() reports it on every rank
        self.sync(ctx)

    def close(self) -> None:
        self.wait(timeout=10.0)  # on the way out after an error: do not wait for a long generation


def make_schedule(cfg) -> SyncSchedule:
    s = cfg.train.schedule
    if s == "staged":
        return StagedSchedule(cfg.train.stages, cfg.train.steps)
    if s == "async":
        return AsyncSchedule(cfg.train.max_staleness)
    return SyncSchedule()


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
