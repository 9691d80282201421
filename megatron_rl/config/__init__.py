"""Run configuration: dataclass tree (schema.py; the env and judge sections in env_section.py and
judge_section.py) + YAML/CLI reading (loader.py); the engines
own sections by registration (engine_sections.py). The whole start-up load, with the user's
plugins and the rules across components, is megatron_rl.configure.load_config."""
from megatron_rl.config.loader import (
    MEGATRON_FLAGS,
    ConfigError,
    build_config,
    config_to_dict,
    parse_overrides,
    read_config,
)
from megatron_rl.config.schema import (
    DataSection,
    LogSection,
    LossSection,
    ModelSection,
    MoESection,
    OptimSection,
    PrecisionSection,
    RolloutSection,
    RunConfig,
    SFTSection,
    TrainSection,
)

__all__ = [
    "MEGATRON_FLAGS",
    "ConfigError",
    "DataSection",
    "LogSection",
    "LossSection",
    "MoESection",
    "ModelSection",
    "OptimSection",
    "PrecisionSection",
    "RolloutSection",
    "RunConfig",
    "SFTSection",
    "TrainSection",
    "build_config",
    "config_to_dict",
    "parse_overrides",
    "read_config",
]
