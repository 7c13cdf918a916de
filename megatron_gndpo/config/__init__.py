"""Typed, frozen configuration: schema, strict YAML/override loading, field docs, extras.

A leaf of the package: what a config must satisfy across components is checked in
:mod:`megatron_gndpo.checks`.
"""

from megatron_gndpo.config.extras import MissingExtraError, check_environment, require_package
from megatron_gndpo.config.loader import (
    ConfigError,
    load_config,
    parse_overrides,
    save_resolved,
    to_dict,
    to_yaml,
)
from megatron_gndpo.config.paths import save_dir
from megatron_gndpo.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    NamedTeacherConfig,
    OptimizerConfig,
    ParallelConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
    teacher_sections,
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
    "NamedTeacherConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RolloutConfig",
    "TeacherConfig",
    "TrainerConfig",
    "check_environment",
    "load_config",
    "parse_overrides",
    "require_package",
    "save_dir",
    "save_resolved",
    "teacher_sections",
    "to_dict",
    "to_yaml",
]
