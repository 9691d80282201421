"""Environments for multi-turn rollouts (base.py: the contract and `register_env`): `calculator`
(a tool call answers arithmetic; the `multiplication` task's environment) and `guess` (a
number-guessing game with higher/lower feedback; the `guessing` task's), and `remote`: any of
them, or the user's, run by an environment server in another process or host (remote.py,
server.py)."""

from megatron_rl.data.envs.base import ENVS, Environment, Step, make_env, register_env
from megatron_rl.data.envs.calculator import Calculator
from megatron_rl.data.envs.guess import Guess
from megatron_rl.data.envs.remote import RemoteEnv

__all__ = ["ENVS", "Calculator", "Environment", "Guess", "RemoteEnv", "Step", "make_env", "register_env"]
