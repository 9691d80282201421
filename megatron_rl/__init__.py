"""megatron-rl: RL post-training for (MoE) LLMs on megatron-core.

Subpackages: config, parallel, platform, model, logprobs, losses, moe, rollout, data, rewards,
precision, metrics, trainer. See README.md.
"""

__version__ = "0.1.0"
