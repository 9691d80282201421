"""The registered rollout engines, one line each (rollout/engine.py: the protocol and EngineSpec).

A new engine is a module with its class and `EngineSpec`, plus one line here (a test may register
a toy one itself: tests/unit/rollout/test_toy_seams.py)."""
from megatron_rl.rollout.embedded import EMBEDDED
from megatron_rl.rollout.engine import ENGINES
from megatron_rl.rollout.vllm import VLLM

ENGINES.add("embedded", EMBEDDED)
ENGINES.add("vllm", VLLM)
