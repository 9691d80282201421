"""MoE router replay in the RL step (R2 / R3), on megatron_rl.moe's controller.

    R2: the π_old pass records each MoE layer's top-k per token; every update pass replays it.
    R3: the rollout engine's routing is replayed in the π_old pass and every update pass.
Positions the engine gave no routing for (prompt tokens of engines that report generated tokens
only, samples without routing) take the live router's choice from a recording pass of θ_old,
i.e. they behave as R2 (megatron replays whole layers, not single tokens).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from megatron_rl.moe import (
    RolloutRouting,
    RouterReplayController,
    TokenLayout,
    finish_routing_metrics,
    live_routing_needed,
    micro_batches_for,
    reduce_routing_sums,
    replay_routing,
    replayed_token_sums,
    routing_agreement_sums,
)
from megatron_rl.moe.metrics import add_sums
from megatron_rl.moe.plumbing import local_mask
from megatron_rl.trainer.passes import logprob_pass

MODES = ("none", "r2", "r3")


@dataclass
class RoutingPlan:
    """What the update passes replay (per micro-batch of the π_old pass) and the metric sums."""

    replay: list | None
    sums: dict

    def update_context(self, controller, slices, micro_batch_size: int, probe: bool):
        if self.replay is None:
            return nullcontext(None)
        return controller.replay(micro_batches_for(self.replay, slices, micro_batch_size), probe=probe)

    def metrics(self) -> dict[str, float]:
        return finish_routing_metrics(reduce_routing_sums(self.sums)) if self.sums else {}


def old_pass(mode: str, controller: RouterReplayController | None, policy, groups, local, samples, rows,
             settings) -> tuple[torch.Tensor | None, torch.Tensor | None, RoutingPlan]:
    """π_old log-probs (and entropy) of `local` under the replay `mode`, and the plan for updates.

    samples: the full broadcast sample list (routing is read from it); rows: this rank's row index.
    """
    if mode == "none" or controller is None:
        old, entropy = logprob_pass(policy.model, groups, local, settings)
        return old, entropy, RoutingPlan(None, {})
    mbs = settings.micro_batch_size
    slices = [slice(i, i + mbs) for i in range(0, local.size, mbs)]
    layout = TokenLayout.from_groups(groups, controller.config.sequence_parallel)
    routing = RolloutRouting.from_samples(samples, local.input_len + 1).select(rows)
    wrap = controller.wrap_forward_step
    sums: dict = {}
    if mode == "r2":
        with controller.record() as recorded:
            old, entropy = logprob_pass(policy.model, groups, local, settings, wrap_step=wrap)
        recorded = [r.with_mask(local_mask(routing.real[sl], layout)) for r, sl in zip(recorded, slices)]
        if routing.experts is not None:  # the engine reported routing: how often it agrees with θ_old
            for r, sl in zip(recorded, slices):
                engine = replay_routing(routing.select(sl), layout, controller.layer_ids, controller.num_experts,
                                        live=r)
                sums = add_sums(sums, routing_agreement_sums(r.indices, engine.indices, engine.mask,
                                                             controller.layer_ids, controller.num_moe_layers,
                                                             "route_agree_rollout_train"))
        return old, entropy, RoutingPlan(recorded, sums)
    live = [None] * len(slices)
    if live_routing_needed(routing):  # positions without engine routing take θ_old's live choice
        with controller.record() as live:
            logprob_pass(policy.model, groups, local, settings, need_entropy=False, wrap_step=wrap)
    r3 = [replay_routing(routing.select(sl), layout, controller.layer_ids, controller.num_experts, live=live[j])
          for j, sl in enumerate(slices)]
    with controller.replay(r3, probe=True) as session:
        old, entropy = logprob_pass(policy.model, groups, local, settings, wrap_step=wrap)
    sums = add_sums(replayed_token_sums(routing), session.agreement_sums("route_agree_rollout_train"))
    return old, entropy, RoutingPlan(r3, sums)
