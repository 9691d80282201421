"""Environments the environment-server test serves besides the built-in ones (imported by the server
process through --plugins): one that fails and one that hangs."""
import threading
from dataclasses import dataclass

from megatron_rl.data.envs import Environment, register_env

FOREVER = threading.Event()  # never set: the hanging step waits until the process ends


@register_env("test_fail")
@dataclass
class Fail(Environment):
    def reset(self, example):
        return example.prompt

    def step(self, text, ids):
        raise RuntimeError("the tool's sandbox is gone")


@register_env("test_hang")
@dataclass
class Hang(Environment):
    def reset(self, example):
        return example.prompt

    def step(self, text, ids):
        FOREVER.wait()
