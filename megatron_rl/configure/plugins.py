"""The config's plugins, loaded before the config tree is built: its sections check their names
against the registries in __post_init__, so what a plugin registers must be there first.

    load_plugins(data)     # configure.load_config calls it on the merged YAML + overrides, on every rank

`plugins: [module, ...]` imports each module (for the entries it registers with register_reward,
register_task, register_env or ROLLOUT_FNS.add); then each name written as an import path
(`package.module:attribute`) in `data.reward`, `data.tasks[i]`, `env.name` and `rollout.function`
is imported, checked and registered under that name (megatron_rl/plugins.py); a task of a task
family (`reasoning_gym:<dataset>`, data/tasks/base.py: TASK_FAMILIES) is made and registered by its
family instead, which imports its package only then. A module that
cannot be imported, a missing attribute, or one of the wrong kind is a ConfigError naming the
field. Only the config being loaded is resolved: a checkpoint's stored config is compared with
it as data (trainer/resume_check.py) and never imports anything.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.data.envs.base import ENV_PLUGINS
from megatron_rl.data.tasks.base import TASK_PLUGINS, TASKS, add_family_task, family_of
from megatron_rl.plugins import PluginError, PluginSlot, import_module, is_import_path, resolve
from megatron_rl.rewards.registry import REWARD_PLUGINS, REWARDS
from megatron_rl.rollout.function import ROLLOUT_FN_PLUGINS


def load_plugins(data: dict) -> None:
    """Import `data["plugins"]` and register the import-path names of `data` (a config as plain
    data). Raises ConfigError naming the field."""
    modules = data.get("plugins")
    if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
        raise ConfigError(f"plugins={modules!r}: a list of module names to import, e.g. [my_rewards]")
    for i, module in enumerate(modules or []):
        try:
            import_module(module)
        except PluginError as e:
            raise ConfigError(f"plugins[{i}]={module!r}: {e}") from None
    tasks = _section(data, "data").get("tasks")
    for i, task in enumerate(tasks if isinstance(tasks, list) else []):
        if family_of(task) is not None:
            try:
                add_family_task(task)
            except ValueError as e:
                raise ConfigError(f"data.tasks[{i}]={task!r}: {e}") from None
    for where, name, slot in _named(data):
        try:
            resolve(name, slot)
        except PluginError as e:
            raise ConfigError(f"{where}: {e}") from None
    _check_task_rewards(data)


def _section(data: dict, name: str) -> dict:
    value = data.get(name)
    return value if isinstance(value, dict) else {}


def _named(data: dict) -> Iterator[tuple[str, Any, PluginSlot]]:
    """(field, name, slot) of every registry name in `data` that may be an import path."""
    section = _section(data, "data")
    if is_import_path(section.get("reward")):
        yield "data.reward", section["reward"], REWARD_PLUGINS
    tasks = section.get("tasks")
    for i, task in enumerate(tasks if isinstance(tasks, list) else []):
        if is_import_path(task):
            yield f"data.tasks[{i}]", task, TASK_PLUGINS
    name = _section(data, "env").get("name")
    if is_import_path(name):
        yield "env.name", name, ENV_PLUGINS
    function = _section(data, "rollout").get("function")
    if is_import_path(function):
        yield "rollout.function", function, ROLLOUT_FN_PLUGINS


def _check_task_rewards(data: dict) -> None:
    """Without data.reward each task is scored by its own `reward`, which must be registered (a
    plugin task may name one its module registers, or one by import path)."""
    section = _section(data, "data")
    tasks = section.get("tasks")
    if section.get("reward") is not None or section.get("jsonl") is not None or not isinstance(tasks, list):
        return
    for i, task in enumerate(tasks):
        if task not in TASKS:
            continue  # the schema names an unknown task
        reward = TASKS[task].reward
        try:
            resolve(reward, REWARD_PLUGINS)
        except PluginError as e:
            raise ConfigError(f"data.tasks[{i}]={task!r}: its reward: {e}") from None
        if reward not in REWARDS:
            raise ConfigError(f"data.tasks[{i}]={task!r}: its reward {reward!r} is not a registered reward "
                              f"(available: {', '.join(sorted(REWARDS))}); register it with @register_reward in "
                              f"a module of `plugins`, name it by import path, or set data.reward")
