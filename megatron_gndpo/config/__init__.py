"""Typed, frozen configuration: schema, strict YAML/override loading, validation, field docs."""

from megatron_gndpo.config.loader import (
    ConfigError,
    load_config,
    parse_overrides,
    save_resolved,
    to_dict,
    to_yaml,
)
from megatron_gndpo.config.paths import check_paths, save_dir
from megatron_gndpo.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)
from megatron_gndpo.config.validate import (
    MissingExtraError,
    check_environment,
    layout_of,
    require_package,
    validate,
)

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "MissingExtraError",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RolloutConfig",
    "TeacherConfig",
    "TrainerConfig",
    "check_environment",
    "check_paths",
    "layout_of",
    "load_config",
    "parse_overrides",
    "require_package",
    "save_dir",
    "save_resolved",
    "to_dict",
    "to_yaml",
    "validate",
]
