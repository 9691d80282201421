"""The run's configuration, whole: what the entry point loads at start-up on every rank.

    cfg = load_config("examples/demo_cpu.yaml", ["train.steps=10"])   # ConfigError naming the field

1. `config.read_config`: the YAML file with the overrides on top, recipes expanded (plain data);
2. `plugins.load_plugins`: the user's modules imported, their names registered, before anything
   checks a name against a registry;
3. `config.build_config`: the RunConfig, each section checking its own values (the engines'
   own sections are registered by importing megatron_rl.rollout, which this package does);
4. `rules.validate`: the rules across sections and registered components.

This is the layer above the config, rollout and trainer packages: it imports their registries so
that none of them has to import another's (the config package imports neither).
"""
from __future__ import annotations

from megatron_rl.config import ConfigError, RunConfig, build_config, read_config
from megatron_rl.configure.plugins import load_plugins
from megatron_rl.configure.rules import validate


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """The checked RunConfig of the YAML file `path` (None: the defaults) with `overrides`
    (`section.field=value` or Megatron-style flags). Raises ConfigError naming the field and the fix."""
    data = read_config(path, overrides)
    load_plugins(data)
    cfg = build_config(data)
    try:
        validate(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


__all__ = ["load_config", "load_plugins", "validate"]
