"""Model FLOPs per token of a GPT, model FLOPs utilisation (MFU), and device peak FLOP/s.

Counting convention (the one of Megatron-LM's ``num_floating_point_operations`` and of the PaLM
paper's MFU, Appendix B): only matrix multiplications count, at 2 FLOPs per multiply-add.
Embedding lookups, norms, rotary, softmax and other element-wise work are left out, and so is
activation recomputation, so MFU compares the work the model needs, not the work the hardware
did. A training token costs 3× a forward token (forward, gradient w.r.t. activations, gradient
w.r.t. weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_gndpo.config.schema import ModelConfig

# Forward + backward (data gradient) + backward (weight gradient): each GEMM runs three times.
_TRAINING_MULTIPLIER = 3.0

# Peak dense (no 2:4 sparsity) bf16 tensor-core FLOP/s per device, from the vendors' data sheets.
# Keys are matched as case-insensitive substrings of the device name (torch.cuda.get_device_name
# reports e.g. "NVIDIA H100 80GB HBM3"); the longest matching key wins, so "H100 PCIe" beats
# "H100".
PEAK_BF16_FLOPS: dict[str, float] = {
    "H100": 989e12,  # SXM
    "H100 PCIe": 756e12,
    "H200": 989e12,  # also matches GH200, the same GPU
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "B200": 2250e12,
    "L40S": 362e12,
}


def gpt_flops_per_token(
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: float,
    num_attention_heads: int,
    num_query_groups: int,
    head_dim: int,
    vocab_size: int,
    seq_len: float,
    swiglu: bool,
    *,
    training: bool,
) -> float:
    """Matmul FLOPs per token of a decoder-only GPT with grouped-query attention.

    With h = hidden_size, f = ffn_hidden_size, q = num_attention_heads · head_dim,
    k = num_query_groups · head_dim, V = vocab_size, s = seq_len, one forward token costs

        per layer:  2·h·(q + 2k)          QKV projection
                  + 2·q·s/2 + 2·q·s/2     scores Q·Kᵀ and the weighted sum of values
                  + 2·q·h                 output projection
                  + 2·h·f·(3 or 2)        MLP: gate, up and down with SwiGLU; up and down without
        once:       2·h·V                 logits

    Causal halving: token i attends to i keys, so the attention terms use the average s/2 keys
    per query (Megatron-LM and FlashAttention's benchmarks do the same; the exact average
    (s + 1)/2 differs by one key). For a batch of sequences of different lengths, pass
    ``seq_len = attention_seq_len(lengths)``; then tokens × this value is the batch's exact
    count. ``training=True`` returns 3× the forward cost. ``vocab_size`` is the logits width
    actually computed (padded, if the embedding is padded).
    """
    for name, value in (
        ("num_layers", num_layers),
        ("hidden_size", hidden_size),
        ("ffn_hidden_size", ffn_hidden_size),
        ("num_attention_heads", num_attention_heads),
        ("num_query_groups", num_query_groups),
        ("head_dim", head_dim),
        ("vocab_size", vocab_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be non-negative, got {seq_len}")
    q_dim = num_attention_heads * head_dim
    kv_dim = num_query_groups * head_dim
    mlp_matmuls = 3 if swiglu else 2
    per_layer = (
        2 * hidden_size * (q_dim + 2 * kv_dim)
        + 2 * (2 * q_dim * seq_len / 2)
        + 2 * q_dim * hidden_size
        + 2 * hidden_size * ffn_hidden_size * mlp_matmuls
    )
    forward = num_layers * per_layer + 2 * hidden_size * vocab_size
    return forward * _TRAINING_MULTIPLIER if training else float(forward)


def model_flops_per_token(model: ModelConfig, seq_len: float, *, training: bool) -> float:
    """``gpt_flops_per_token`` for a ``ModelConfig`` (its defaults for GQA and head size).

    Uses the unpadded ``vocab_size``: padding rows carry no model work. An MoE layer does the
    work of its top-k routed experts and its shared expert per token (the router's is left
    out), averaged over the layers as an equivalent dense FFN width.
    """
    heads = model.num_attention_heads
    ffn = float(model.ffn_hidden_size)
    if model.is_moe:
        active = model.moe_router_topk * model.expert_ffn_hidden_size
        active += model.moe_shared_expert_ffn_hidden_size
        moe_layers = sum(model.moe_layers)
        ffn = (moe_layers * active + (model.num_layers - moe_layers) * ffn) / model.num_layers
    return gpt_flops_per_token(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=model.num_query_groups or heads,
        head_dim=model.kv_channels or model.hidden_size // heads,
        vocab_size=model.vocab_size,
        seq_len=seq_len,
        swiglu=model.swiglu,
        training=training,
    )


def attention_seq_len(lengths: Iterable[int]) -> float:
    """The seq_len that makes ``tokens × gpt_flops_per_token`` exact for sequences of these lengths.

    Attention work grows with the square of each sequence's length, so the right average is
    Σ s² / Σ s (length-weighted), not the plain mean. 0.0 for no tokens.
    """
    total = squares = 0
    for length in lengths:
        total += length
        squares += length * length
    return squares / total if total else 0.0


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over peak FLOP/s, as a fraction in [0, 1].

    ``flops`` and ``peak_flops`` must cover the same devices: the whole job's FLOPs with
    peak × number of GPUs, or one GPU's share with one GPU's peak.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return flops / seconds / peak_flops


def update_mfu(
    model: ModelConfig, lengths: list[int], seconds: float, *, replicas: int, world_size: int
) -> dict[str, float]:
    """``{"mfu": ...}`` of an update stage of ``seconds`` on rows of ``lengths`` (this replica's;
    ``replicas`` data-parallel replicas each process as many) over ``world_size`` GPUs; ``{}``
    without a GPU of known peak or a timed update."""
    import torch

    if not torch.cuda.is_available():
        return {}
    peak = peak_flops_for(torch.cuda.get_device_name())
    if peak is None or seconds <= 0:
        return {}
    flops_per_token = model_flops_per_token(model, attention_seq_len(lengths), training=True)
    return {"mfu": mfu(flops_per_token * sum(lengths) * replicas, seconds, peak * world_size)}


def peak_flops_for(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device named like ``torch.cuda.get_device_name()``.

    None for a device not in ``PEAK_BF16_FLOPS`` (a CPU, an unlisted GPU): log no MFU then.
    """
    name = device_name.lower()
    matches = [key for key in PEAK_BF16_FLOPS if key.lower() in name]
    if not matches:
        return None
    return PEAK_BF16_FLOPS[max(matches, key=len)]
