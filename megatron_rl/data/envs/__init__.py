"""Environments for multi-turn rollouts (base.py: the contract and `register_env`): `calculator`
(a tool call answers arithmetic; the `multiplication` task's environment)."""

from megatron_rl.data.envs.base import ENVS, Environment, Step, make_env, register_env
from megatron_rl.data.envs.calculator import Calculator

__all__ = ["ENVS", "Calculator", "Environment", "Step", "make_env", "register_env"]
