"""What Megatron-LM and Megatron-Bridge read beside the tensors of a dist-checkpoint.

Both find and load a megatron-core ``torch_dist`` step directory (``iter_XXXXXXX/`` with
``metadata.json``) as we write it; what they need besides is written by
:func:`megatron_gndpo.checkpoint.dist.save_checkpoint` from the values built here:

Megatron-LM (``megatron/training/checkpointing.py``)
    ``latest_checkpointed_iteration.txt`` at the root: the step as text (``read_metadata``).
    In the step's common state (``dist_checkpointing.load_common_state_dict``): ``args`` (an
    ``argparse.Namespace``; ``load_args_from_checkpoint`` and ``check_checkpoint_args`` read the
    architecture and layout fields of :func:`megatron_lm_args`, ``build_tokenizer`` its
    ``tokenizer_type`` / ``tokenizer_model`` when the run's tokenizer is one Megatron-LM has),
    ``checkpoint_version`` (3.0) and ``iteration``; the save's ``content_metadata``
    (``load_content_metadata``).
    ``no_save_optim`` / ``no_save_rng`` are true: our optimizer state and RNG are not in its
    layout, so a plain ``--load`` takes the weights and starts a fresh optimizer.

Megatron-Bridge (``megatron/bridge/training/checkpointing.py``, ``utils/checkpoint_utils.py``,
``training/model_load_save.py``)
    ``latest_train_state.pt`` at the root and ``train_state.pt`` in the step: the
    ``TrainState.state_dict()`` tensors of :func:`bridge_train_state`. ``run_config.yaml`` in
    the step: its ``model`` section is instantiated (``_target_``) by ``load_model_config`` and
    built by ``AutoBridge.load_megatron_model`` / ``export_ckpt`` (written for GPTModel
    checkpoints only: ``model_class: hybrid`` gets none); resuming reads
    ``model.tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` and
    ``checkpoint.save_rng`` / ``save_optim`` / ``fully_parallel_save``.

Reading these back (a checkpoint one of those tools wrote): ``checkpoint/foreign_config.py``.
"""

from __future__ import annotations

import argparse
import io
import os
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.config.schema import ModelConfig
from megatron_gndpo.models import naming

MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
BRIDGE_TRACKER = "latest_train_state.pt"
BRIDGE_TRAIN_STATE = "train_state.pt"
BRIDGE_RUN_CONFIG = "run_config.yaml"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current one (generate_state_dict)
_BRIDGE_PROVIDER = "megatron.bridge.models.gpt_provider.GPTModelProvider"
# What AutoTokenizer.from_pretrained (Megatron-LM's HuggingFaceTokenizer) needs in a directory.
_HF_TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json")


def megatron_lm_tokenizer_args(tokenizer: str | None) -> dict[str, str]:
    """Megatron-LM's ``tokenizer_type`` / ``tokenizer_model`` for our ``data.tokenizer``: a
    Hugging Face directory is its ``HuggingFaceTokenizer``, a SentencePiece ``.model`` file its
    ``GPTSentencePieceTokenizer`` (the decoder one: the file's own special tokens, none added).
    Empty for the built-in tokenizer, none, or a directory without a tokenizer (a model's
    without one): Megatron-LM has no equivalent. The path is made absolute (Megatron-LM
    resolves it from its own working directory)."""
    if tokenizer is None or tokenizer.startswith("builtin:"):
        return {}
    if tokenizer.endswith(".model"):
        kind = "GPTSentencePieceTokenizer"
    elif any((Path(tokenizer) / name).is_file() for name in _HF_TOKENIZER_MARKERS):
        kind = "HuggingFaceTokenizer"
    else:
        return {}
    return {"tokenizer_type": kind, "tokenizer_model": os.path.abspath(tokenizer)}


def megatron_lm_args(
    model: ModelConfig,
    *,
    step: int,
    tp: int,
    pp: int,
    world_size: int,
    tokenizer: str | None = None,
) -> argparse.Namespace:
    """Megatron-LM's ``args`` for a checkpoint of ``model`` saved at TP=``tp``, PP=``pp``; with
    the run's ``tokenizer`` (``data.tokenizer``), also its tokenizer arguments. A HybridModel
    (``model_class: hybrid``) is described as its ``pretrain_hybrid.py`` takes it: the layer
    pattern (without pipeline separators) and one layer per pattern symbol."""
    hybrid: dict[str, Any] = {}
    if model.model_class == "hybrid":
        pattern = naming.hybrid_pattern(model.moe_layers)
        hybrid = dict(hybrid_layer_pattern=pattern, is_hybrid_model=True)
    return argparse.Namespace(
        **megatron_lm_tokenizer_args(tokenizer),
        **hybrid,
        # architecture (load_args_from_checkpoint, check_checkpoint_args)
        num_layers=2 * model.num_layers if hybrid else model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        group_query_attention=model.query_groups != model.num_attention_heads,
        num_query_groups=model.query_groups,
        kv_channels=model.head_dim,
        max_position_embeddings=model.max_position_embeddings,
        seq_length=model.max_position_embeddings,
        position_embedding_type=model.position_embedding,
        add_position_embedding=model.position_embedding == "learned_absolute",
        use_rotary_position_embeddings=model.position_embedding == "rope",
        rotary_base=int(model.rotary_base),
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=model.rotary_scaling_factor is not None,
        rope_scaling_factor=model.rotary_scaling_factor or 1.0,
        normalization=model.normalization,
        norm_epsilon=model.norm_epsilon,
        apply_layernorm_1p=False,
        swiglu=model.swiglu,
        squared_relu=False,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        untie_embeddings_and_output_weights=not model.tie_embeddings,
        apply_query_key_layer_scaling=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        vocab_size=model.vocab_size,
        padded_vocab_size=model.padded_vocab_size(tp),
        make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
        params_dtype=_TORCH_DTYPE[model.params_dtype],
        bf16=model.params_dtype == "bf16",
        fp16=model.params_dtype == "fp16",
        # layout and what the checkpoint holds (load_checkpoint)
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        world_size=world_size,
        data_parallel_size=world_size // (tp * pp),
        iteration=step,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        no_save_optim=True,
        no_save_rng=True,
        ckpt_fully_parallel_save=False,
        consumed_train_samples=0,
        skipped_train_samples=0,
        consumed_valid_samples=0,
    )


def megatron_lm_common(
    model: ModelConfig | None,
    *,
    step: int,
    tp: int,
    pp: int,
    world_size: int,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """The entries Megatron-LM reads from a step's common state (``args`` needs ``model``)."""
    common: dict[str, Any] = {"checkpoint_version": CHECKPOINT_VERSION, "iteration": step}
    if model is not None:
        common["args"] = megatron_lm_args(
            model, step=step, tp=tp, pp=pp, world_size=world_size, tokenizer=tokenizer
        )
    return common


def bridge_train_state(step: int) -> dict[str, torch.Tensor]:
    """Megatron-Bridge's ``TrainState.state_dict()`` for a checkpoint at ``step``."""
    return {
        "step": torch.tensor(step, dtype=torch.int64),
        "consumed_train_samples": torch.tensor(0, dtype=torch.int64),
        "skipped_train_samples": torch.tensor(0, dtype=torch.int64),
        "consumed_valid_samples": torch.tensor(0, dtype=torch.int64),
        "floating_point_operations_so_far": torch.tensor(0.0, dtype=torch.float64),
        "do_train": torch.tensor(False),
        "do_valid": torch.tensor(False),
        "do_test": torch.tensor(False),
    }


def bridge_train_state_bytes(step: int) -> bytes:
    """:func:`bridge_train_state` as ``torch.save`` writes it (``train_state.pt``)."""
    buffer = io.BytesIO()
    torch.save(bridge_train_state(step), buffer)
    return buffer.getvalue()


def write_bridge_step_files(
    directory: Path, step: int, model: ModelConfig | None, *, tp: int, pp: int
) -> None:
    """Megatron-Bridge's files in a step directory: its train state, and its run config when
    the architecture (``model``) is known."""
    import yaml

    (directory / BRIDGE_TRAIN_STATE).write_bytes(bridge_train_state_bytes(step))
    # Bridge builds a HybridModel from its Mamba provider, whose fields are not verified here:
    # a hybrid checkpoint gets no run config (Bridge then needs the architecture from its user)
    if model is not None and model.model_class == "gpt":
        config = bridge_run_config(model, tp=tp, pp=pp)
        (directory / BRIDGE_RUN_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))


def bridge_run_config(model: ModelConfig, *, tp: int, pp: int) -> dict[str, Any]:
    """Megatron-Bridge's ``run_config.yaml`` (as a dict) for a checkpoint of ``model``: a
    ``GPTModelProvider`` of its architecture, and the checkpoint section a resume reads."""
    dtype = {"_target_": str(_TORCH_DTYPE[model.params_dtype]), "_call_": False}
    provider: dict[str, Any] = {
        "_target_": _BRIDGE_PROVIDER,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.query_groups,
        "kv_channels": model.head_dim,
        "vocab_size": model.vocab_size,
        "should_pad_vocab": False,
        "make_vocab_size_divisible_by": model.make_vocab_size_divisible_by,
        "seq_length": model.max_position_embeddings,
        "position_embedding_type": model.position_embedding,
        "rotary_base": int(model.rotary_base),
        "rope_scaling": model.rotary_scaling_factor is not None,
        "rope_scaling_factor": model.rotary_scaling_factor or 1.0,
        "normalization": model.normalization,
        "layernorm_epsilon": model.norm_epsilon,
        "gated_linear_unit": model.swiglu,
        "activation_func": {
            "_target_": "torch.nn.functional.silu" if model.swiglu else "torch.nn.functional.gelu",
            "_call_": False,
        },
        "add_bias_linear": model.add_bias_linear,
        "add_qkv_bias": model.add_qkv_bias,
        "qk_layernorm": model.qk_layernorm,
        "share_embeddings_and_output_weights": model.tie_embeddings,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "init_method_std": model.init_method_std,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "bf16": model.params_dtype == "bf16",
        "fp16": model.params_dtype == "fp16",
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
    }
    # Our optimizer state and RNG are not in Bridge's layout: never offered to a resume.
    checkpoint = {"save_rng": False, "save_optim": False, "fully_parallel_save": False,
                  "ckpt_format": "torch_dist"}  # fmt: skip
    return {"model": provider, "checkpoint": checkpoint}


_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
