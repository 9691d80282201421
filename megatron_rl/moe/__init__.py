"""MoE router replay (R2 / R3) on megatron-core's RouterReplay, rollout-routing plumbing, metrics
(docs/router_replay.md)."""
from megatron_rl.moe.metrics import routing_agreement_sums
from megatron_rl.moe.plumbing import (
    RolloutRouting,
    TokenLayout,
    live_routing_needed,
    replay_routing,
    replayed_token_sums,
)
from megatron_rl.moe.replay import (
    MicroBatchRouting,
    ReplaySession,
    RouterReplayController,
    check_replay_config,
    micro_batches_for,
)

__all__ = [
    "MicroBatchRouting", "ReplaySession", "RolloutRouting", "RouterReplayController", "TokenLayout",
    "check_replay_config", "live_routing_needed", "micro_batches_for", "replay_routing", "replayed_token_sums",
    "routing_agreement_sums",
]
