"""The rollout side's registered entries, one line each: engines (rollout/engine.py) and rollout
functions (rollout/function.py). A new one is a module with its class and spec plus one line here
(a test may register a toy one itself: tests/distributed/test_toy_seams.py)."""
from megatron_rl.rollout.embedded import EMBEDDED
from megatron_rl.rollout.engine import ENGINES
from megatron_rl.rollout.function import ROLLOUT_FNS
from megatron_rl.rollout.multi_turn import MULTI_TURN
from megatron_rl.rollout.single_turn import SINGLE_TURN
from megatron_rl.rollout.vllm import VLLM

ENGINES.add("embedded", EMBEDDED)
ENGINES.add("vllm", VLLM)

ROLLOUT_FNS.add("single_turn", SINGLE_TURN)
ROLLOUT_FNS.add("multi_turn", MULTI_TURN)
