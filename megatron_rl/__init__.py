"""megatron-rl: RL post-training for (MoE) LLMs on megatron-core.

Subpackages: config, parallel, platform, model, logprobs, losses, moe, rollout, data, rewards,
metrics, trainer. See README.md and docs/.
"""

__version__ = "0.1.0"
