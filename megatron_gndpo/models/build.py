"""The one entry point that builds a language model from a :class:`ModelConfig`.

``model.model_class`` picks the megatron-core class: ``gpt`` builds a GPTModel
(``models/gpt.py``), ``hybrid`` a HybridModel of the same layers (``models/hybrid.py``). Both
take the same arguments, hold their parameters under names ``models/naming.py`` relates, and
serve every caller alike (scoring, the update, rollouts, checkpoints, conversion).
"""

from __future__ import annotations

from typing import Any

from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.parallel.groups import ParallelGroups


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    groups: ParallelGroups,
    *,
    parallel_output: bool = True,
) -> Any:
    """This rank's shard of ``model`` (its TP slice of its PP stage's layers), as the class
    ``model.model_class`` names; see ``models.gpt.build_gpt`` for the arguments."""
    if model.model_class == "hybrid":
        from megatron_gndpo.models.hybrid import build_hybrid

        return build_hybrid(model, parallel, groups, parallel_output=parallel_output)
    from megatron_gndpo.models.gpt import build_gpt

    return build_gpt(model, parallel, groups, parallel_output=parallel_output)


def build_teacher(model: ModelConfig, parallel: ParallelConfig, groups: ParallelGroups) -> Any:
    """The frozen teacher: eval mode, no gradients, no optimizer state, its own layout."""
    from megatron_gndpo.models.gpt import freeze

    return freeze(build_model(model, parallel, groups))
