"""The rollout side: the engine seam (engine.py: RolloutEngine, ENGINES), the rollout-function seam
(function.py: RolloutFn, ROLLOUT_FNS), what they exchange (types.py), the embedded engine, the vLLM
backend, and the default single-turn function. Importing the package registers them (registered.py)."""
from megatron_rl.rollout import registered  # noqa: F401 - fills the registries
from megatron_rl.rollout.engine import (
    ENGINES,
    WEIGHT_SYNCS,
    EngineNeeds,
    EngineRequest,
    EngineSpec,
    RolloutEngine,
    WeightSyncSpec,
    weight_sync,
)
from megatron_rl.rollout.function import ROLLOUT_FNS, Generated, RolloutFn, RolloutFnInputs, RolloutFnSpec
from megatron_rl.rollout.types import Sample, SamplingParams

__all__ = ["ENGINES", "ROLLOUT_FNS", "WEIGHT_SYNCS", "EngineNeeds", "EngineRequest", "EngineSpec", "Generated",
           "RolloutEngine", "RolloutFn", "RolloutFnInputs", "RolloutFnSpec", "Sample", "SamplingParams", "WeightSyncSpec",
           "weight_sync"]
