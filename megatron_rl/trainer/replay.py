"""MoE router replay in the RL step as one strategy object: none, R2 or R3 (docs/router_replay.md).

    replay = make_replay(cfg.moe.router_replay, policy.model)
    old, entropy = replay.old_pass(policy, groups, local, routing, settings)   # π_old
    with replay.update(slices, mbs):            # every update pass (and per-step statistics)
        train_pass(..., wrap_step=replay.wrap)
    values = replay.metrics()                   # routing agreement, metrics convention (world-reduced)

Engine-vs-trainer agreement is also reported by policy turn when the batch has turns
(TrainBatch.turns, multi-turn trajectories): moe/route_agree_rollout_train/turn/<t>.

    R2: the π_old pass records each MoE layer's top-k per token; every update pass replays it.
    R3: the rollout engine's routing is replayed in the π_old pass and every update pass.

Positions the engine gave no routing for (prompt tokens of engines that report generated tokens
only, samples without routing) take the live router's choice from a recording pass of θ_old,
i.e. they behave as R2 (megatron replays whole layers, not single tokens).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol

import torch

from megatron_rl.metrics.reduce import accumulate, reduce_metrics
from megatron_rl.moe import (
    RouterReplayController,
    TokenLayout,
    live_routing_needed,
    micro_batches_for,
    replay_routing,
    replayed_token_sums,
    routing_agreement_sums,
)
from megatron_rl.moe.metrics import routing_agreement_by_turn
from megatron_rl.moe.plumbing import local_mask
from megatron_rl.trainer.passes import logprob_pass


class Replay(Protocol):
    """A router replay strategy (the module docstring shows its use). wrap: wraps the update pass's
    forward step (or None); layer_ids: the MoE layers (indices among all of the model's) whose
    engine routing this rank reads, its pipeline stage's (trainer/scatter.py sends it only those),
    or None when it reads no routing."""

    mode: str
    wrap: Callable | None
    layer_ids: tuple[int, ...] | None

    def old_pass(self, policy, groups, local, routing, settings):
        """π_old log-probs [N, L] and entropy of the local rows, or (None, None) off the last stage.
        routing: this rank's part of the engine's RolloutRouting (its rows, CP columns and
        `layer_ids`; trainer/scatter.py), None when the strategy reads none."""

    def update(self, slices, micro_batch_size: int, probe: bool = False) -> AbstractContextManager: ...

    def metrics(self) -> dict[str, torch.Tensor]: ...


class NoReplay:
    """The routers route live in every pass."""

    mode = "none"
    wrap = None
    layer_ids = None

    def old_pass(self, policy, groups, local, routing, settings):
        return logprob_pass(policy.model, groups, local, settings)

    def update(self, slices, micro_batch_size: int, probe: bool = False):
        return nullcontext()

    def metrics(self) -> dict[str, torch.Tensor]:
        return {}


class _Replay:
    """What R2 and R3 share: the controller, the per-micro-batch routing the updates replay, and
    the step's routing values (reset by each old_pass)."""

    mode = ""
    probe_updates = False  # measure θ_old vs θ agreement in the updates (R2)

    def __init__(self, model):
        self.controller = RouterReplayController(model)
        self.wrap = self.controller.wrap_forward_step
        self.layer_ids = self.controller.layer_ids
        self._routing: list | None = None
        self._values: dict[str, torch.Tensor] = {}

    def _slices(self, local, settings) -> list[slice]:
        mbs = settings.micro_batch_size
        return [slice(i, i + mbs) for i in range(0, local.size, mbs)]

    def _layout(self, groups) -> TokenLayout:
        return TokenLayout.from_groups(groups, self.controller.config.sequence_parallel)

    @staticmethod
    def _turns(local, sl: slice, layout: TokenLayout):
        """`[local_tokens]` policy turn of each token of micro-batch `sl` (None: no turns)."""
        return None if local.turns is None else layout.to_local(local.turns[sl])

    @contextmanager
    def update(self, slices, micro_batch_size: int, probe: bool = True):
        """Replay the recorded routing of `slices` in the passes run inside; with `probe` (and a
        strategy that measures it) add θ_old vs θ agreement to the step's values."""
        probe = probe and self.probe_updates
        with self.controller.replay(micro_batches_for(self._routing, slices, micro_batch_size), probe) as session:
            yield
        if probe:
            self._values = accumulate(self._values, session.agreement_sums("route_agree_old_new"))

    def metrics(self) -> dict[str, torch.Tensor]:
        return self._values


class R2Replay(_Replay):
    """Record θ_old's routing in the π_old pass, replay it in every update."""

    mode = "r2"
    probe_updates = True

    def old_pass(self, policy, groups, local, routing, settings):
        ctl, layout = self.controller, self._layout(groups)
        with ctl.record() as recorded:
            old, entropy = logprob_pass(policy.model, groups, local, settings, wrap_step=self.wrap)
        slices = self._slices(local, settings)
        self._routing = [r.with_mask(local_mask(routing.real[sl], layout)) for r, sl in zip(recorded, slices)]
        self._values = {}
        if routing.experts is not None:  # the engine reported routing: how often it agrees with θ_old
            for r, sl in zip(self._routing, slices):
                engine = replay_routing(routing.select(sl), layout, ctl.layer_ids, ctl.num_experts, live=r)
                self._values = accumulate(self._values, routing_agreement_sums(
                    r.indices, engine.indices, engine.mask, ctl.layer_ids, ctl.num_moe_layers,
                    "route_agree_rollout_train"))
                turns = self._turns(local, sl, layout)
                if turns is not None:
                    self._values = accumulate(self._values, routing_agreement_by_turn(
                        r.indices, engine.indices, engine.mask, turns, "route_agree_rollout_train"))
        return old, entropy


class R3Replay(_Replay):
    """Replay the rollout engine's routing in the π_old pass and every update."""

    mode = "r3"

    def old_pass(self, policy, groups, local, routing, settings):
        ctl, layout = self.controller, self._layout(groups)
        slices = self._slices(local, settings)
        live = [None] * len(slices)
        # positions without engine routing take θ_old's live choice; every rank decides alike (the
        # recording pass runs the model's collectives, e.g. EP all-to-alls)
        needed = torch.tensor(float(live_routing_needed(routing)), dtype=torch.float64)
        if reduce_metrics({"needed/max": needed})["needed/max"] > 0:
            with ctl.record() as live:
                logprob_pass(policy.model, groups, local, settings, need_entropy=False, wrap_step=self.wrap)
        self._routing = [replay_routing(routing.select(sl), layout, ctl.layer_ids, ctl.num_experts, live=live[j])
                         .with_turns(self._turns(local, sl, layout)) for j, sl in enumerate(slices)]
        with ctl.replay(self._routing, probe=True) as session:
            old, entropy = logprob_pass(policy.model, groups, local, settings, wrap_step=self.wrap)
        self._values = accumulate(replayed_token_sums(routing), session.agreement_sums("route_agree_rollout_train"))
        return old, entropy


REPLAYS = {"none": NoReplay, "r2": R2Replay, "r3": R3Replay}


def make_replay(mode: str, model):
    """The strategy for moe.router_replay=`mode` on `model` (built with routing replay when not none)."""
    return NoReplay() if mode == "none" else REPLAYS[mode](model)
