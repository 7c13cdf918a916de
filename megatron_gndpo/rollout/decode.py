"""A lean KV-cached forward of a megatron-core GPTModel's (or HybridModel's) own layers.

Why not megatron's static inference path: its ``StaticInferenceContext`` caches keys before
RoPE and rotates the whole cache again at every step (a step's cost grows with the cached
length), every row must sit at the same position, and each token runs the full training
forward (schedule, block, layer, attention and linear wrappers: ~1,200 torch ops per step for a
4-layer model). Its fast decoding paths (``flash_decode``, the dynamic engine) need flash-attn,
i.e. CUDA. This forward computes what a TransformerLayer computes in eval from the same
parameters, with far fewer ops:

- megatron's own modules where they hold no wiring (the embedding, the norms, q/k norms);
- each linear from its weight: ``x @ W^T``, the all-reduce a row-parallel layer does, the bias
  (:class:`_Linear`; on the CPU through oneDNN with the weight packed once per generate, or
  MKL for a few rows on an Intel CPU);
- keys rotated once, as they are written into a slot cache ``[slots, ng, S, hn]``;
- each row at its own position: a prefill writes whole prompts (right-padded, causal), a decode
  step writes one position per row and attends to that row's cached keys only;
- slots are plain rows of the cache, so finished rows can be replaced (:meth:`SlotCache.move`).

:func:`unsupported_reason` names what it does not reproduce (those models take megatron's
static path). A HybridModel (``model.model_class: hybrid``) runs the same way: its attention and
MLP layers are walked in pairs, as GPT layers (``models/naming.decoder_blocks``). Tokens are
laid out token-major, ``[N, h]`` with ``N`` = rows x chunk positions
(megatron's ``[s, b, h]`` with one "sequence" of all tokens: every op but the attention is per
token). Pipeline stages pass those hidden states point to point, in stage order.

Legend: B = rows in the chunk, T = chunk positions, N = B*T tokens, S = cache length, L =
attended length, h = hidden, np / ng = query / KV heads on this TP rank, hn = head dim,
V = vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_gndpo.models import naming
from megatron_gndpo.parallel.groups import ParallelGroups


class LogitsHead(Protocol):
    """Turns this TP rank's logits of the rows' last positions into sampling logits."""

    def gathered(self, logits_bv: torch.Tensor, tp_group: Any) -> torch.Tensor:
        """float32 ``[b, V]`` logits from this rank's vocabulary shard ``[b, V/tp]``."""
        ...


def inner_model(model: Any) -> Any:
    """The module under megatron's wrappers (DDP, Float16Module): the language model itself."""
    while hasattr(model, "module"):
        model = model.module
    return model


# The module attributes megatron reads for sequence parallelism at run time (the linears',
# the embeddings'), as megatron's own static engine switches them (set_model_to_sequence_parallel).
_SEQUENCE_PARALLEL_ATTRS = ("sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def sequence_parallel_off(model: Any) -> Iterator[None]:
    """Run ``model`` (any wrapper of it) without sequence parallelism while inside.

    Sequence parallelism splits a forward's sequence over the TP ranks, which a decode step of
    one position per row cannot be; in eval without gradients it changes only where the
    activations are split, not what is computed. So rollouts switch it off, as megatron's own
    static engine does: the config's flag and each module's copy of it, restored on exit (not
    through megatron's ``set_model_to_sequence_parallel``, whose module cache is keyed by
    ``id(model)`` and outlives the model).
    """
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    if not config.sequence_parallel:
        yield
        return
    switched = [
        (module, attr)
        for module in model.modules()
        for attr in _SEQUENCE_PARALLEL_ATTRS
        if getattr(module, attr, None) is True
    ]
    config.sequence_parallel = False
    for module, attr in switched:
        setattr(module, attr, False)
    try:
        yield
    finally:
        config.sequence_parallel = True
        for module, attr in switched:
            setattr(module, attr, True)


def unsupported_reason(model: Any) -> str | None:
    """Why :class:`CachedDecoder` cannot run this model (None: it can).

    The decoder reuses megatron's modules but not its attention or layer wiring, so it accepts
    only the layer structure whose wiring it reproduces: pre-norm dense layers with megatron's
    own (non-Transformer-Engine) linears, plain RoPE or learned positions, vanilla softmax.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if not isinstance(model, GPTModel | HybridModel):
        return f"the model is a {type(model).__name__}, not a megatron GPTModel or HybridModel"
    cfg = model.config
    checks = {
        "FP8": bool(cfg.fp8),
        "multi-latent attention": bool(getattr(cfg, "multi_latent_attention", False)),
        "interleaved RoPE": bool(cfg.rotary_interleaved),
        "layers without RoPE (no_rope_freq)": bool(getattr(cfg, "no_rope_freq", None)),
        "an attention output gate": bool(getattr(cfg, "attention_output_gate", False)),
        "a non-vanilla softmax": getattr(cfg, "softmax_type", "vanilla") != "vanilla",
        "sliding-window attention": getattr(cfg, "window_size", None) is not None,
        "residuals after the norm": bool(cfg.apply_residual_connection_post_layernorm),
        "fp32 residuals": bool(cfg.fp32_residual_connection),
        "context parallelism": cfg.context_parallel_size != 1,
        # a decode step cannot split one position over TP ranks: decode inside
        # sequence_parallel_off (the built-in generator does)
        "sequence parallelism (decode inside sequence_parallel_off)": bool(cfg.sequence_parallel),
        "mixture of experts": bool(cfg.num_moe_experts),
        "MuP scaling": bool(getattr(cfg, "use_mup", False)),
        "query-key layer scaling": bool(cfg.apply_query_key_layer_scaling),
        "a clamped or offset GLU": getattr(cfg, "activation_func_clamp_value", None) is not None
        or bool(getattr(cfg, "glu_linear_offset", 0.0)),
        # megatron all-gathers the QKV projection then; its static path covers it
        "fewer KV heads than TP ranks": (cfg.num_query_groups or cfg.num_attention_heads)
        < cfg.tensor_model_parallel_size,
    }
    found = [name for name, present in checks.items() if present]
    if found:
        return "the model uses " + ", ".join(found)
    if model.position_embedding_type not in ("rope", "learned_absolute", "none"):
        return f"position embedding {model.position_embedding_type!r}"
    if (
        model.position_embedding_type == "rope"
        and type(model.rotary_pos_emb) is not RotaryEmbedding
    ):
        return f"rotary embedding {type(model.rotary_pos_emb).__name__}"
    for attn_layer, mlp_layer in naming.decoder_blocks(model):
        for layer in (attn_layer, mlp_layer):
            if not isinstance(layer, TransformerLayer):
                return f"a layer is a {type(layer).__name__}"
        attn, mlp = attn_layer.self_attention, mlp_layer.mlp
        if not isinstance(attn, SelfAttention) or not isinstance(mlp, MLP):
            return "a layer is not self-attention + dense MLP"
        if not all(
            isinstance(m, IdentityOp)
            for m in (attn_layer.cross_attention, attn_layer.pre_cross_attn_layernorm)
        ):
            return "a layer has cross-attention"
        linears = (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1, mlp.linear_fc2)
        if not all(isinstance(x, ColumnParallelLinear | RowParallelLinear) for x in linears):
            # Transformer Engine's linears fuse the norm in (and may compute in FP8): the
            # decoder multiplies the weights of megatron's own linears only
            return "Transformer Engine layers"
    return None


@dataclasses.dataclass
class SlotCache:
    """Rotated keys and values of this stage's layers, ``[slots, ng, S, hn]`` per layer."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def move(self, dst: list[int], src: list[int]) -> None:
        """Copy slots ``src`` into slots ``dst`` (pairwise; how finished rows are replaced)."""
        if not dst or not self.keys:
            return
        device = self.keys[0].device
        to, frm = torch.tensor(dst, device=device), torch.tensor(src, device=device)
        for cache in (*self.keys, *self.values):
            cache.index_copy_(0, to, cache.index_select(0, frm))


@dataclasses.dataclass(frozen=True)
class _Step:
    """What the layers of one forward share (on the model's device)."""

    b: int
    t: int
    positions: torch.Tensor  # [B, T]
    rows: torch.Tensor  # [B]: 0..B-1
    cos: torch.Tensor | None  # [B, T, 1, d] (None: no RoPE)
    sin: torch.Tensor | None
    length: int  # keys attended: 0..length-1
    attn_mask: torch.Tensor | None  # [B, 1, 1, length] (rows at different positions)
    is_causal: bool  # a prefill


class CachedDecoder:
    """Prefill and decode steps through one pipeline stage of a GPTModel or HybridModel (see
    module docstring).

    Every rank of the model replica calls the same steps in the same order; the last stage
    returns the logits of each row's last position (float32 ``[B, V]``), the others None.
    """

    def __init__(
        self, model: Any, groups: ParallelGroups, head: LogitsHead, *, max_length: int
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"CachedDecoder cannot run this model: {reason}")
        self.model = model
        self.groups = groups
        self.head = head
        self.config = model.config
        self.layers = naming.decoder_blocks(model)  # (attention, MLP) sublayers per GPT layer
        attn = self.layers[0][0].self_attention if self.layers else None
        self.query_heads = attn.num_attention_heads_per_partition if attn else 0
        self.kv_heads = attn.num_query_groups_per_partition if attn else 0
        self.head_dim = attn.hidden_size_per_attention_head if attn else 0
        self.scale = attn.core_attention.softmax_scale if attn else 1.0
        pp_ranks = dist.get_process_group_ranks(groups.pp) if groups.layout.pp > 1 else []
        stage = dist.get_rank(group=groups.pp) if pp_ranks else 0
        self.prev_rank = pp_ranks[stage - 1] if pp_ranks and stage > 0 else None
        self.next_rank = pp_ranks[stage + 1] if pp_ranks and stage + 1 < len(pp_ranks) else None
        self.max_length = max_length  # positions the RoPE table covers
        self.device = next(model.parameters()).device
        self._linears: list[_LayerLinears] | None = None  # made by prepare()
        self._output: _Linear | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin [max_length, d]

    def new_cache(self, slots: int, length: int) -> SlotCache:
        shape = (slots, self.kv_heads, length, self.head_dim)
        dtype, device = self.config.params_dtype, self.device
        # zeros, not empty: a masked key still meets its value in SDPA (0 x NaN = NaN)
        return SlotCache(
            keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
            values=[torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers],
        )

    def prepare(self, rows: int) -> None:
        """Before a generate of up to ``rows`` rows: this stage's linears (:class:`_Linear`)."""
        self.device = next(self.model.parameters()).device
        self._linears = [
            _LayerLinears(*(_Linear.of(m, rows) for m in (attn.self_attention.linear_qkv,
                            attn.self_attention.linear_proj, mlp.mlp.linear_fc1,
                            mlp.mlp.linear_fc2)))
            for attn, mlp in self.layers
        ]  # fmt: skip
        if self.next_rank is None:  # the last stage: the output layer too
            self._output = _Linear.plain(self._output_weight(), rows)

    def release(self) -> None:
        """After a generate: drop the packed weights."""
        self._linears, self._output = None, None

    def prefill(
        self,
        cache: SlotCache,
        first_slot: int,
        tokens_BT: torch.Tensor,
        last_B: torch.Tensor,
        embeddings_TBH: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Write whole prompts (right-padded, from position 0) into slots ``first_slot...``.

        ``last_B[b]`` is row b's last prompt position: its logits are returned. Positions past
        a row's prompt hold padding; their keys are overwritten before any query sees them.
        ``embeddings_TBH`` replaces the token embedding on the first stage (images).
        """
        b, t = tokens_BT.shape
        positions_BT = torch.arange(t).expand(b, t)
        slots = slice(first_slot, first_slot + b)
        return self._forward(cache, slots, tokens_BT, positions_BT, last_B, embeddings_TBH)

    def decode(
        self, cache: SlotCache, tokens_B: torch.Tensor, positions_B: torch.Tensor
    ) -> torch.Tensor | None:
        """One token per row of slots ``0..B-1``: row b's token sits at ``positions_B[b]``."""
        b = tokens_B.shape[0]
        last_B = torch.zeros(b, dtype=torch.long)
        return self._forward(
            cache, slice(0, b), tokens_B[:, None], positions_B[:, None], last_B, None
        )

    # -- one forward through this stage ---------------------------------------------------

    def _forward(
        self,
        cache: SlotCache,
        slots: slice,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor,  # host int64
        last_B: torch.Tensor,  # host int64: which position of each row gives the logits
        embeddings_TBH: torch.Tensor | None,
    ) -> torch.Tensor | None:
        b, t = tokens_BT.shape
        device = self.device
        x = self._stage_input(tokens_BT, positions_BT, embeddings_TBH)  # [N, h]
        if self.layers:
            step = self._step(positions_BT)
            assert self._linears is not None, "call prepare() before a generate"
            for i, (layer, linears) in enumerate(zip(self.layers, self._linears, strict=True)):
                keys, values = cache.keys[i][slots], cache.values[i][slots]
                x = self._layer(layer, linears, x, keys, values, step)
        if self.next_rank is not None:
            dist.send(x.contiguous(), dst=self.next_rank, group=self.groups.pp)
            return None
        return self._logits(x, last_B.to(device) + torch.arange(b, device=device) * t)

    def _stage_input(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        embeddings_TBH: torch.Tensor | None,
    ) -> torch.Tensor:
        """This stage's input ``[N, h]``: received, or the embeddings on the first stage."""
        b, t = tokens_BT.shape
        n, device = b * t, self.device
        if self.prev_rank is not None:
            x = torch.empty(n, self.config.hidden_size, dtype=self.config.pipeline_dtype,
                            device=device)  # fmt: skip
            dist.recv(x, src=self.prev_rank, group=self.groups.pp)
            return x
        if embeddings_TBH is not None:
            return embeddings_TBH.transpose(0, 1).reshape(n, -1)
        ids, pos = tokens_BT.reshape(1, n).to(device), positions_BT.reshape(1, n).to(device)
        out: torch.Tensor = self.model.embedding(input_ids=ids, position_ids=pos)  # [N, 1, h]
        return out.view(n, -1)

    def _step(self, positions_BT: torch.Tensor) -> _Step:
        """What every layer of one forward shares: RoPE at the positions, the attention mask.
        ``positions_BT`` is on the host: the shapes are decided there, without a device sync."""
        b, t = positions_BT.shape
        length = int(positions_BT.max()) + 1
        same = bool((positions_BT == length - 1).all())  # every row at the same position
        positions = positions_BT.to(self.device)
        cos = sin = None
        if self.model.position_embedding_type == "rope":
            table_cos, table_sin = self._rotary()
            cos, sin = table_cos[positions].unsqueeze(2), table_sin[positions].unsqueeze(2)
        rows = torch.arange(b, device=positions.device)
        if t > 1:  # a prefill from position 0: plain causal
            return _Step(b, t, positions, rows, cos, sin, length, None, is_causal=True)
        keep = None
        if not same:  # rows at different positions: each sees its own keys only
            keys = torch.arange(length, device=positions.device)
            keep = (keys[None, :] <= positions).view(b, 1, 1, length)
        return _Step(b, t, positions, rows, cos, sin, length, keep, is_causal=False)

    def _rotary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``cos`` and ``sin`` per position (megatron's own frequencies), made once."""
        if self._rope is None:
            freqs = self.model.rotary_pos_emb(self.max_length).reshape(self.max_length, -1)
            dtype = self.config.params_dtype
            # as megatron's apply_rotary_pos_emb: cos/sin in float32, then the activations' dtype
            self._rope = (torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype))
        return self._rope

    def _layer(
        self,
        layer: tuple[Any, Any],  # its attention and MLP sublayers (the same module in a GPT)
        linears: _LayerLinears,
        x: torch.Tensor,  # [N, h]
        keys: torch.Tensor,  # [B, ng, S, hn], this chunk's slots
        values: torch.Tensor,
        step: _Step,
    ) -> torch.Tensor:
        """One TransformerLayer as megatron computes it in eval (pre-norm; residual + (out +
        bias); no dropout), its linears called directly (:class:`_Linear`)."""
        b, t = step.b, step.t
        attn_layer, mlp_layer = layer
        attn = attn_layer.self_attention
        mixed = linears.qkv(attn_layer.input_layernorm(x))
        q, k, v = self._rotated_qkv(attn, mixed, step)  # [B, T, heads, hn]
        if t == 1:  # one position per row: write each row's key at its own position
            keys[step.rows, :, step.positions[:, 0]] = k[:, 0]
            values[step.rows, :, step.positions[:, 0]] = v[:, 0]
        else:  # a prefill from position 0
            keys[:, :, :t] = k.transpose(1, 2)
            values[:, :, :t] = v.transpose(1, 2)
        context = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [B, np, T, hn]
            keys[:, :, : step.length],
            values[:, :, : step.length],
            attn_mask=step.attn_mask,
            is_causal=step.is_causal,
            scale=self.scale,
            enable_gqa=self.query_heads != self.kv_heads,
        )
        context = context.transpose(1, 2).reshape(b * t, -1)  # [N, np*hn]
        x = x + linears.proj(context)  # megatron's bias-dropout-add in eval
        hidden = linears.fc1(mlp_layer.pre_mlp_layernorm(x))
        if self.config.gated_linear_unit:
            gate, linear = torch.chunk(hidden, 2, dim=-1)
            hidden = self.config.activation_func(gate) * linear
        else:
            hidden = self.config.activation_func(hidden)
        return x + linears.fc2(hidden)

    def _rotated_qkv(
        self, attn: Any, mixed: torch.Tensor, step: _Step
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[B, T, heads, hn]`` from the QKV projection ``[N, ...]``:
        split as ``get_query_key_value_tensors`` splits it (per KV group: its queries, its key,
        its value), queries and keys normed (Qwen3) and rotated. Without q/k norms the queries
        and the key of a group are rotated in one go (they sit side by side)."""
        per_group, hn = self.query_heads // self.kv_heads, self.head_dim
        mixed = mixed.view(step.b, step.t, self.kv_heads, per_group + 2, hn)
        v = mixed[:, :, :, per_group + 1]
        normed = attn.q_layernorm is not None or attn.k_layernorm is not None
        if not normed:
            qk = mixed[:, :, :, : per_group + 1]
            if step.cos is not None and step.sin is not None:
                qk = _rotate(qk, step.cos.unsqueeze(3), step.sin.unsqueeze(3))
            q = qk[:, :, :, :per_group].reshape(step.b, step.t, self.query_heads, hn)
            return q, qk[:, :, :, per_group], v
        q = mixed[:, :, :, :per_group].reshape(step.b, step.t, self.query_heads, hn)
        k = mixed[:, :, :, per_group]
        if attn.q_layernorm is not None:
            q = attn.q_layernorm(q)
        if attn.k_layernorm is not None:
            k = attn.k_layernorm(k)
        if step.cos is not None and step.sin is not None:
            q, k = _rotate(q, step.cos, step.sin), _rotate(k, step.cos, step.sin)
        return q, k, v

    def _tied_weight(self) -> torch.Tensor | None:
        """The embedding the output layer shares (GPTModel.forward's ``output_weight``)."""
        model = self.model
        tied = model.share_embeddings_and_output_weights
        return model.shared_embedding_or_output_weight() if tied else None

    def _output_weight(self) -> torch.Tensor:
        tied = self._tied_weight()
        return self.model.output_layer.weight if tied is None else tied

    def _logits(self, x: torch.Tensor, picked_B: torch.Tensor) -> torch.Tensor:
        """Logits of the tokens ``picked_B`` (indices into the stage's ``N`` tokens): the final
        norm and the output layer (or the tied embedding) on those tokens only."""
        hidden_bh = x[picked_B]  # [B, h]
        final_norm = naming.final_norm(self.model)
        if final_norm is not None:
            hidden_bh = final_norm(hidden_bh)
        assert self._output is not None, "call prepare() before a generate"
        return self.head.gathered(self._output(hidden_bh), self.model.output_layer.tp_group)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``[B, T, heads, hn]`` as megatron applies it (non-interleaved halves)."""
    d = cos.shape[-1]
    rotated, passed = x[..., :d], x[..., d:]
    x1, x2 = rotated.chunk(2, dim=-1)
    rotated = rotated * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, passed), dim=-1) if passed.shape[-1] else rotated


# Which CPU GEMM a decode step's linears run, by host and rows a step (measured: oneDNN on
# weights reordered for it, as torch.compile's and vLLM's CPU backends run, or torch's matmul,
# i.e. MKL). On the 2-core AMD EPYC hosts of benchmarks/results/rollout-cpu-2026-12-02.md MKL's
# small GEMMs were 2-3x slower than oneDNN's; on the 2-core Intel Xeon (AVX-512) host of
# real-model-cpu-2026-12-08.md MKL's are faster below 8 rows (SmolLM2-135M decode, tokens/s
# MKL / oneDNN: 1.31 at 1 row, 1.65 at 2, 1.13 at 4) and slower from 8 (0.90 at 8, 0.93 at 16).
# A fixed rule, not a timing at run time: the same host takes the same path every run, so a
# seeded rollout stays reproducible.
_MKL_BELOW_ROWS = 8


@functools.cache
def _intel_cpu() -> bool:
    """Whether this host's CPU is Intel's (MKL's own fast paths; Linux's /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.split(":")[-1].strip() == "GenuineIntel"
                       for line in f if line.startswith("vendor_id"))  # fmt: skip
    except OSError:
        return False


def _onednn(weight: torch.Tensor, rows: int) -> bool:
    """Whether ``weight``'s GEMMs at ``rows`` rows a step go through oneDNN with a packed copy
    (fp32 on the CPU; not for few rows on an Intel CPU, where MKL's are faster)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and not (rows < _MKL_BELOW_ROWS and _intel_cpu())
    )


@dataclasses.dataclass(frozen=True)
class _Linear:
    """One linear layer for one generate: ``x @ W^T``, all-reduced over ``reduce_group`` (a
    row-parallel layer at TP > 1, as its forward does), plus the bias (which megatron adds
    there or, with ``skip_bias_add``, in the bias-dropout-add right after). ``packed`` is the
    weight reordered for oneDNN (:func:`_onednn`); it is made per generate because the
    trainer updates the weights in place between generates."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    reduce_group: Any
    packed: torch.Tensor | None

    @classmethod
    def of(cls, module: Any, rows: int) -> _Linear:
        """A megatron Column/RowParallelLinear (eval, no sequence parallelism)."""
        from megatron.core.tensor_parallel.layers import RowParallelLinear

        row_parallel = isinstance(module, RowParallelLinear) and module.tp_group.size() > 1
        return cls.plain(
            module.weight, rows, module.bias, module.tp_group if row_parallel else None
        )

    @classmethod
    def plain(
        cls, weight: torch.Tensor, rows: int, bias: torch.Tensor | None = None, group: Any = None
    ) -> _Linear:
        packed = None
        if _onednn(weight, rows):  # ``rows``: the GEMMs' expected row count, oneDNN's blocking hint
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        return cls(weight, bias, group, packed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.bias if self.reduce_group is None else None  # the bias rides with the GEMM
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, fused, "none", [], ""
            )
        else:
            out = torch.matmul(x, self.weight.t())
            if fused is not None:
                out = out + fused
        if self.reduce_group is not None:
            dist.all_reduce(out, group=self.reduce_group)
            if self.bias is not None:
                out = out + self.bias
        return out


@dataclasses.dataclass(frozen=True)
class _LayerLinears:
    qkv: _Linear
    proj: _Linear
    fc1: _Linear
    fc2: _Linear
