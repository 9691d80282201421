"""Rollout engines: the contract (types.py), the embedded in-process engine, the vLLM backend."""
from megatron_rl.rollout.types import RolloutEngine, Sample, SamplingParams

__all__ = ["RolloutEngine", "Sample", "SamplingParams"]
