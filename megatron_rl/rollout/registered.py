"""The rollout side's registered entries, one line each: weight syncs and engines (rollout/engine.py),
serving dialects (rollout/serving/dialect.py) and rollout functions (rollout/function.py). A new one
is a module with its class and spec plus one line here (a test may register a toy one itself:
tests/distributed/test_toy_seams.py, tests/vllm/test_toy_dialect.py)."""
from megatron_rl.rollout.embedded import EMBEDDED
from megatron_rl.rollout.engine import ENGINES, WEIGHT_SYNCS, WeightSyncSpec
from megatron_rl.rollout.function import ROLLOUT_FNS
from megatron_rl.rollout.multi_turn import MULTI_TURN
from megatron_rl.rollout.serving import DIALECTS
from megatron_rl.rollout.single_turn import SINGLE_TURN
from megatron_rl.rollout.vllm import VLLM
from megatron_rl.rollout.vllm.dialect import VLLM_DIALECT

WEIGHT_SYNCS.add("memory", WeightSyncSpec(transport="memory"))   # tensors streamed: embedded, vllm
WEIGHT_SYNCS.add("reload", WeightSyncSpec(transport="disk"))     # an HF folder reloaded in place: vllm
WEIGHT_SYNCS.add("restart", WeightSyncSpec(transport="disk"))    # an HF folder, a fresh server on it: vllm

ENGINES.add("embedded", EMBEDDED)
ENGINES.add("vllm", VLLM)

DIALECTS.add("vllm", VLLM_DIALECT)                               # a server kind the engine speaks to

ROLLOUT_FNS.add("single_turn", SINGLE_TURN)
ROLLOUT_FNS.add("multi_turn", MULTI_TURN)
