"""Which model class wrote a checkpoint, and loading a GPTModel checkpoint into a HybridModel.

A HybridModel (``model.model_class: hybrid``) loads what a GPTModel run saved (a resume with its
optimizer state, a teacher, initial weights): its sharded state dict is pointed at the GPT
checkpoint's keys before the load (:func:`retarget_to_gpt`), so nothing is rewritten on disk
and dist-checkpointing still reshards across TP/PP/EP. The names follow ``models/naming.py``:

- a dense GPT checkpoint stores its layers in megatron's homogeneous format (one key per
  parameter, the layer index a leading axis): megatron-core's own
  ``gpt_checkpoint_interop.retarget_sharded_state_dict_to_gpt_checkpoint`` rewrites the hybrid
  keys onto it (with its ``gpt_compatible_layer_maps`` of our ``*-`` pattern);
- a mixture-of-experts GPT checkpoint stores every layer under its index
  (``decoder.layers.i.``, megatron's format for MoE layer lists): each key is renamed
  (:func:`~megatron_gndpo.models.naming.to_gpt`);
- the final norm reads GPT's ``decoder.final_layernorm``; HybridModel's empty
  ``output_layer._extra_state``, which GPTModel never saves, stays local.

The optimizer state needs no translation: it is saved in the distributed optimizer's bucket
layout (``dp_reshardable``), and a HybridModel built here holds the same parameters in the same
order as the GPTModel (the attention and MLP of GPT layer ``i`` are its layers ``2i`` and
``2i+1``), so its buckets are the GPT run's, parameter for parameter
(``tests/test_hybrid.py`` resumes one from the other and continues bitwise alike).

The reverse, a HybridModel checkpoint into a GPTModel, is refused (:func:`match`): GPTModel is
the class megatron-core is removing, and its checkpoint format has no place for layer kinds a
hybrid pattern may hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_gndpo.config.schema import ModelClass
from megatron_gndpo.models import naming

# A key only a checkpoint of that class holds (every model saves its final norm).
_FINAL_NORM_KEYS = {
    "gpt": naming.GPT_FINAL_NORM + "weight",
    "hybrid": naming.HYBRID_FINAL_NORM + "weight",
}
# GPTModel's homogeneous layer format: keys without a layer index.
_HOMOGENEOUS_MARKER = "decoder.layers.self_attention."


def saved_layout(keys: set[str]) -> tuple[ModelClass | None, bool]:
    """(the class that saved a checkpoint holding tensor ``keys``, whether its layers are in the
    homogeneous format). The class is None when neither's final norm is there (a
    vision-language model's checkpoint)."""
    homogeneous = any(key.startswith(_HOMOGENEOUS_MARKER) for key in keys)
    for model_class, key in _FINAL_NORM_KEYS.items():
        if key in keys:
            return model_class, homogeneous  # type: ignore[return-value]
    return None, homogeneous


def match(
    directory: Path,
    sharded_model: dict[str, Any],
    model: Any,
    saved: tuple[ModelClass | None, bool],
) -> str:
    """Make ``model``'s sharded state dict load the checkpoint in ``directory`` (of
    :func:`saved_layout` ``saved``): a GPTModel checkpoint into a HybridModel is retargeted in
    place. Returns why it cannot load (empty when it can): a HybridModel checkpoint into a
    GPTModel."""
    saved_class, homogeneous = saved
    loading = naming.model_class_of(model)
    if saved_class == "gpt" and loading == "hybrid":
        retarget_to_gpt(sharded_model, model, homogeneous=homogeneous)
    if saved_class == "hybrid" and loading == "gpt":
        return (
            f"{directory} was saved by a HybridModel (model_class: hybrid) and a GPTModel "
            "cannot load it: set model_class: hybrid in the model section that loads it "
            "(model.model_class for the student and checkpoint.init, teacher.model.model_class "
            "for a teacher); a HybridModel loads checkpoints of either class"
        )
    return ""


def retarget_to_gpt(sharded_model: dict[str, Any], model: Any, *, homogeneous: bool) -> None:
    """Point a HybridModel's sharded state dict (``model``'s, one model chunk) at the keys of a
    GPTModel checkpoint, in place; ``homogeneous``: the checkpoint's layers are in megatron's
    homogeneous format (module docstring)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps,
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    while hasattr(model, "module"):
        model = model.module
    if homogeneous:
        maps = gpt_compatible_layer_maps(model.hybrid_layer_pattern)
        retarget_sharded_state_dict_to_gpt_checkpoint(sharded_model, maps)
        return

    def rename(entry: Any) -> Any:
        if not isinstance(entry, ShardedBase):
            return entry
        if entry.key.endswith("output_layer._extra_state"):
            return LocalNonpersistentObject(entry.data)
        entry.key = naming.to_gpt(entry.key)
        return entry

    dict_list_map_inplace(rename, sharded_model)
