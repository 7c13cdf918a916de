"""The pruned student's weights: the teacher's, with layers left out and FFN neurons cut.

    cfg = student_config(teacher_cfg, num_layers=len(keep), ffn_hidden_size=F or None)
    state = pruned_state(teacher_state, keep, neurons=[idx_F per kept layer] or None,
                         swiglu=teacher_cfg.swiglu)
    student.load_state_dict(state)

Every tensor outside the decoder layers (embedding, final norm, output layer) is the teacher's.
Kept layer ``keep[j]`` becomes layer ``j``. With ``neurons``, layer ``j``'s FFN keeps the rows of
``linear_fc1`` (both halves of a SwiGLU's ``[gate; up]``, stacked as megatron stores them at
TP=1) and the columns of ``linear_fc2`` of those neurons; nothing else changes width. State
dicts are TP=1/PP=1 (``prune/run.py`` loads and saves at that layout; a saved checkpoint loads
at any other).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

import torch

from megatron_gndpo.config.schema import ModelClass, ModelConfig
from megatron_gndpo.models import naming

# A layer of the language model (a VLM's ``language_model.``; its vision encoder's layers stay).
_LAYER = re.compile(
    r"^(?P<head>(?:language_model\.)?decoder\.layers\.)(?P<index>\d+)\.(?P<rest>.+)$"
)


def student_config(
    teacher: ModelConfig, *, num_layers: int, ffn_hidden_size: int | None = None
) -> ModelConfig:
    """The teacher's architecture with ``num_layers`` layers (and ``ffn_hidden_size``)."""
    if ffn_hidden_size is not None and teacher.is_moe:
        raise ValueError(
            "width pruning (--ffn-hidden-size) takes dense models; a mixture-of-experts model "
            "prunes in depth only"
        )
    width = teacher.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
    return dataclasses.replace(teacher, num_layers=num_layers, ffn_hidden_size=width)


def top_neurons(importance_F: torch.Tensor, width: int) -> torch.Tensor:
    """The indices of the ``width`` most important neurons, in their original order."""
    if not 1 <= width <= importance_F.numel():
        raise ValueError(
            f"cannot keep {width} of {importance_F.numel()} FFN neurons: keep 1 to "
            f"{importance_F.numel()}"
        )
    return torch.topk(importance_F, width).indices.sort().values


def pruned_state(
    teacher: Mapping[str, torch.Tensor],
    keep: Sequence[int],
    *,
    neurons: Sequence[torch.Tensor] | None = None,
    swiglu: bool = True,
    model_class: ModelClass = "gpt",
) -> dict[str, torch.Tensor]:
    """The student's state dict from the teacher's (see the module docstring). A HybridModel's
    names are read as GPT layers (``models/naming.py``) and written back as hybrid ones."""
    if model_class == "hybrid":
        gpt = {naming.to_gpt(k): v for k, v in teacher.items()}
        pruned = pruned_state(gpt, keep, neurons=neurons, swiglu=swiglu)
        return {naming.to_hybrid(k): v for k, v in pruned.items()}
    if neurons is not None and len(neurons) != len(keep):
        raise ValueError(f"neurons: one index tensor per kept layer ({len(keep)}), got "
                         f"{len(neurons)}")  # fmt: skip
    position = {layer: j for j, layer in enumerate(keep)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in teacher.items():
        found = _LAYER.match(name)
        if found is None:
            out[name] = tensor
            continue
        layer = int(found["index"])
        if layer not in position:
            continue
        j, rest = position[layer], found["rest"]
        if neurons is not None:
            tensor = _cut(rest, tensor, neurons[j], swiglu=swiglu)
        out[f"{found['head']}{j}.{rest}"] = tensor
    return out


def _cut(rest: str, tensor: torch.Tensor, idx_F: torch.Tensor, *, swiglu: bool) -> torch.Tensor:
    """One layer tensor with only the FFN neurons ``idx_F`` (other tensors unchanged)."""
    if rest.startswith("mlp.linear_fc1.") and rest.split(".")[-1] in ("weight", "bias"):
        if swiglu:  # [gate; up] rows, F each
            gate, up = tensor.chunk(2, dim=0)
            return torch.cat([gate[idx_F], up[idx_F]], dim=0).clone()
        return tensor[idx_F].clone()
    if rest == "mlp.linear_fc2.weight":  # [H, F]
        return tensor[:, idx_F].clone()
    return tensor
