"""Rollout engines: the contract (types.py, engine.py), the embedded in-process engine, the vLLM
backend; importing the package registers them (engines.py)."""
from megatron_rl.rollout import engines  # noqa: F401 - registers the engines
from megatron_rl.rollout.engine import ENGINES, EngineNeeds, EngineRequest, EngineSpec, RolloutEngine
from megatron_rl.rollout.types import Sample, SamplingParams

__all__ = ["ENGINES", "EngineNeeds", "EngineRequest", "EngineSpec", "RolloutEngine", "Sample", "SamplingParams"]
