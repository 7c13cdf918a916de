"""Built-in prompt sets, generated in code (no data files)."""

from megatron_gndpo.data.tasks import arithmetic, chains
from megatron_gndpo.data.tasks.arithmetic import Problem

__all__ = ["Problem", "arithmetic", "chains"]
