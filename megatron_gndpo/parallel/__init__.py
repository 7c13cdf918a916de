"""Distributed start-up, parallel layouts and process groups (built once, passed down)."""

from megatron_gndpo.parallel.distributed import (
    DistributedEnv,
    detect_env,
    init_distributed,
    shutdown_distributed,
)
from megatron_gndpo.parallel.groups import (
    ParallelGroups,
    ParallelLayout,
    build_groups,
    build_student_groups,
)

__all__ = [
    "DistributedEnv",
    "ParallelGroups",
    "ParallelLayout",
    "build_groups",
    "build_student_groups",
    "detect_env",
    "init_distributed",
    "shutdown_distributed",
]
