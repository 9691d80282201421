"""The engines' own settings sections, `rollout.<engine>`: each engine brings its section with it.

    register_engine_section("vllm", VllmConfig)   # rollout/engine.py's ENGINES.add does this
    engine_sections()                             # {"vllm": VllmConfig, ...}

The config layer knows no engine: the rollout layer registers an engine's section when it
registers the engine (an `EngineSpec` with `settings`), so `RolloutSection` carries one instance
of every registered section (`cfg.rollout.vllm`), the loader builds `rollout.vllm.*` into it, and
`config_to_dict` writes it back under its own name. A section class is a dataclass; it checks its
own values in `__post_init__` and may declare:

    SECRET_FIELDS       fields whose value is replaced by "<redacted>" in the config a checkpoint keeps
    SECRET_MAPPINGS     mapping fields whose values are (their keys stay)
    check_on_this_machine(rollout)   what it needs of the machine the run starts on, given the
                        rollout section it is part of (RunConfig.check_paths)
"""
from __future__ import annotations

import dataclasses

_SECTIONS: dict[str, type] = {}


def register_engine_section(name: str, section: type) -> None:
    """Make `rollout.<name>` a section of class `section` (a dataclass whose fields all have
    defaults). Registering the same class again is a no-op; another class under a taken name, or a
    name that is already a field of the rollout section, is a ValueError."""
    if not dataclasses.is_dataclass(section):
        raise TypeError(f"engine section rollout.{name}: {section!r} is not a dataclass")
    if _SECTIONS.get(name, section) is not section:
        raise ValueError(f"engine section rollout.{name} is already registered ({_SECTIONS[name].__name__})")
    _SECTIONS[name] = section


def unregister_engine_section(name: str) -> None:
    """Forget `rollout.<name>` (a test that registered a toy engine cleans up after itself)."""
    _SECTIONS.pop(name, None)


def engine_sections() -> dict[str, type]:
    """Registered sections by engine name, in name order."""
    return dict(sorted(_SECTIONS.items()))
