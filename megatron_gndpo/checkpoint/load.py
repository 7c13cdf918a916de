"""Build the model a checkpoint holds and load it: one way for every caller outside the trainer
(the demo, ``prune``, the benchmarks).

The architecture comes from the checkpoint itself (:func:`~.convert.saved_model`): the
``model_config.yaml`` beside it (what training, conversion, ``prune`` and the demo write), else
what a Megatron-Bridge or Megatron-LM step says; a ``vision_config.yaml`` beside it makes it a
VLM. ``model.model_class`` picks GPTModel or HybridModel (``models/build.py``). The weights load
at whatever TP/PP/EP they were saved at (dist-checkpointing reshards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from megatron_gndpo.checkpoint.convert import VISION_CONFIG_FILE, saved_model
from megatron_gndpo.checkpoint.dist import load_checkpoint
from megatron_gndpo.config.schema import Dtype, ModelConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.parallel.groups import ParallelGroups


def saved_vision(root: Path) -> VisionConfig | None:
    """A VLM checkpoint's ``vision_config.yaml`` in ``root``; None for a text model."""
    if not (root / VISION_CONFIG_FILE).is_file():
        return None
    from megatron_gndpo.checkpoint.vlm_convert import read_vision_config

    return read_vision_config(root)


def load_model(
    path: str | Path,
    groups: ParallelGroups,
    *,
    model: ModelConfig | None = None,
    vision: VisionConfig | None = None,
    dtype: Dtype | Literal["saved"] | None = None,
    frozen: bool = False,
    vocab_size: int | None = None,
) -> Any:
    """The model checkpoint ``path`` (a root or a step directory) holds, built on ``groups`` at
    their TP/PP and loaded, in eval mode.

    ``model``, ``vision`` and ``dtype`` replace what the checkpoint says
    (:func:`~.convert.saved_model`; ``dtype="saved"``: the dtype its weights were saved in).
    ``frozen``: no gradients either (a teacher: no optimizer state). ``vocab_size``: the
    tokenizer's, which the checkpoint's rows must cover (:func:`~.dist.load_checkpoint`).
    """
    saved = saved_model(path, model, dtype=dtype)
    vision = vision if vision is not None else saved_vision(saved.root)
    parallel = ParallelConfig(tensor_parallel=groups.layout.tp, pipeline_parallel=groups.layout.pp)
    if vision is not None:
        from megatron_gndpo.models.vlm import build_vlm

        net = build_vlm(saved.model, vision, parallel, groups)
    else:
        from megatron_gndpo.models.build import build_model

        net = build_model(saved.model, parallel, groups)
    load_checkpoint(saved.step, net, vocab_size=vocab_size)
    net.eval()
    if frozen:
        net.requires_grad_(False)
    return net
