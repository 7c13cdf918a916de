"""Build megatron-core HybridModels (``model.model_class: hybrid``) with GPTModel's own layers.

Each GPT layer becomes two hybrid layers (pattern ``*-``, ``*E`` for an MoE layer, ``|`` between
pipeline stages; ``models/naming.py``), built from the very ModuleSpecs ``models/gpt.py`` gives
GPTModel, split in two: the attention layer keeps the input norm, the self-attention and its
bias-dropout-add; the MLP layer (``MLPLayer``) keeps the pre-MLP norm, the MLP or MoE block and
its bias-dropout-add. So the same layers run in the same order on the same parameters: local
specs with the SDPA core attention on a CPU, Transformer Engine specs where asked for, dense
and MoE, and the same weights give the same log-probs (``tests/test_hybrid.py``).

Two things megatron-core 0.19's HybridModel does not do as GPTModel does, handled here without
patching it:

- its stack builds the final norm as Transformer Engine's ``TENorm``, which raises without
  Transformer Engine: :class:`HybridStackWithNorm` builds it from the norm GPTModel's block uses
  (megatron's local norm, or ``TENorm`` with the TE spec);
- its ``forward`` has no ``output_processor`` (the hook the log-prob head replaces the output
  layer through): :class:`HookedHybridModel` adds it.

The stock ``hybrid_stack_spec`` is not used: it imports fine without Transformer Engine or
``mamba_ssm`` but names TE layers everywhere, and has no q/k norms (Qwen3).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_gndpo.config.schema import ModelConfig, ParallelConfig
from megatron_gndpo.models import gpt, naming
from megatron_gndpo.parallel.groups import ParallelGroups

# A GPT layer's submodules that go to the hybrid attention layer; the MLP layer takes the rest.
_ATTENTION_FIELDS = ("input_layernorm", "self_attention", "self_attn_bda")
_MLP_FIELDS = ("pre_mlp_layernorm", "mlp", "mlp_bda")
HYBRID_ROPE_SCALING = (
    "model_class=hybrid cannot scale RoPE (rotary_scaling_factor, Llama-3.1): megatron-core "
    "0.19's HybridModel builds its rotary embedding without scaling; use model_class=gpt"
)


class HybridStackWithNorm(HybridStack):
    """megatron's ``HybridStack`` whose final norm is the ModuleSpec ``final_norm`` instead of
    the ``TENorm`` it hard-codes (the same module otherwise: layers, forward, checkpoint)."""

    def __init__(self, config: Any, submodules: Any, *, final_norm: Any, **kwargs: Any) -> None:
        post_layer_norm = kwargs.pop("post_layer_norm", True)
        super().__init__(config, submodules, post_layer_norm=False, **kwargs)
        # forward() applies self.final_norm when post_process and post_layer_norm
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(
                final_norm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )


class HookedHybridModel(HybridModel):
    """megatron's ``HybridModel`` with GPTModel's ``output_processor`` hook: on the last stage
    the processor gets the final hidden states and the output layer instead of the logits being
    computed (``models/logprob_head.py``; the static inference path's last-position head)."""

    def forward(
        self,
        *args: Any,
        output_processor: Any = None,
        output_processor_context: Any = None,
        **kwargs: Any,
    ) -> Any:
        last_stage = bool(self.post_process)  # type: ignore[has-type]
        if output_processor is None or not last_stage:
            return super().forward(*args, **kwargs)
        # Upstream's forward returns the decoder's output (final norm applied) before the output
        # layer when post_process is off; the stack keeps its own flag and still applies the norm.
        self.post_process = False
        try:
            hidden_states = super().forward(*args, **kwargs)
        finally:
            self.post_process = True
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()
        return output_processor(
            hidden_states=hidden_states,
            output_layer=self.output_layer,
            output_weight=output_weight,
            labels=kwargs.get("labels"),
            context=output_processor_context,
            compute_language_model_loss=self.compute_language_model_loss,
            scale_logits=self._scale_logits,
            config=self.config,
        )


def _split(layer: ModuleSpec, fields: tuple[str, ...], module: type) -> ModuleSpec:
    """``layer`` (a GPT layer's spec) reduced to ``fields``, as a ``module`` layer; the checkpoint
    key renames (TE-style norm names) of the fields kept go with them."""
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    whole = layer.submodules
    keys_map = {
        old: new
        for old, new in whole.sharded_state_dict_keys_map.items()
        if old.split(".")[0] in fields
    }
    kept = {name: getattr(whole, name) for name in fields}
    return ModuleSpec(
        module=module,
        submodules=TransformerLayerSubmodules(**kept, sharded_state_dict_keys_map=keys_map),
    )


def stack_spec(model: ModelConfig) -> ModuleSpec:
    """The HybridStack ModuleSpec of ``model``: its GPT layer specs split in two (module
    docstring), local or Transformer Engine as ``model.transformer_impl`` says."""
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    dense = gpt.layer_spec(model, moe=False)
    submodules = HybridStackSubmodules(
        attention_layer=_split(dense, _ATTENTION_FIELDS, TransformerLayer),
        mlp_layer=_split(dense, _MLP_FIELDS, MLPLayer),
    )
    if model.is_moe:
        moe = gpt.layer_spec(model, moe=True)
        submodules = dataclasses.replace(submodules, moe_layer=_split(moe, _MLP_FIELDS, moe.module))
    return ModuleSpec(
        module=HybridStackWithNorm,
        submodules=submodules,
        params={"final_norm": gpt.final_norm_spec(model)},
    )


def transformer_config(model: ModelConfig, parallel: ParallelConfig) -> Any:
    """GPTModel's TransformerConfig of ``model``, with the layers counted as a HybridModel
    counts them: the attention and the MLP of a GPT layer are two layers (and ``is_hybrid_model``
    then scales the output layers' initialisation as GPTModel does)."""
    moe = {"moe_layer_freq": naming.hybrid_moe_layers(model.moe_layers)} if model.is_moe else {}
    return gpt.transformer_config(
        model, parallel, num_layers=2 * model.num_layers, is_hybrid_model=True, **moe
    )


def build_hybrid(
    model: ModelConfig,
    parallel: ParallelConfig,
    groups: ParallelGroups,
    *,
    parallel_output: bool = True,
) -> Any:
    """A :class:`HookedHybridModel` holding this rank's shard; the arguments are those of
    ``models.gpt.build_gpt`` (the same model, as a HybridModel)."""
    common = gpt.language_model_args(model, parallel, groups, parallel_output=parallel_output)
    if model.rotary_scaling_factor is not None:  # checks/rules.py refuses it first
        raise ValueError(HYBRID_ROPE_SCALING)
    return HookedHybridModel(
        config=transformer_config(model, parallel),
        hybrid_stack_spec=stack_spec(model),
        hybrid_layer_pattern=naming.hybrid_pattern(model.moe_layers, parallel.pipeline_parallel),
        **common,
    )
