"""megatron_gndpo: on-policy distillation of reasoning LLMs/MLLMs with GNDPO on megatron-core.

Importing the package is cheap and changes nothing: megatron-core is imported by the modules that
need it, and the CPU compatibility layer is applied only by an explicit
``megatron_gndpo.compat.cpu.enable()``.
"""

from megatron_gndpo.version import __version__

__all__ = ["__version__"]
