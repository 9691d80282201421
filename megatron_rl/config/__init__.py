"""Run configuration: dataclass tree (schema.py) + YAML/CLI loading (loader.py)."""
from megatron_rl.config.loader import (
    MEGATRON_FLAGS,
    ConfigError,
    config_to_dict,
    load_config,
    parse_overrides,
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
    "config_to_dict",
    "load_config",
    "parse_overrides",
]
