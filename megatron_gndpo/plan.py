"""``megatron-gndpo plan``: the parallel layout of both models and their per-rank parameters.

Pure arithmetic: no process group, no GPU, no megatron import, so a 256-rank (or 4096-rank) plan
runs on a laptop. Parameter counts follow megatron-core's local GPT spec exactly (the tests
compare them with real GPTModel shards at TP=1/2 and PP=2): the vocabulary padded to
``make_vocab_size_divisible_by * tp`` and split over TP, attention and MLP matrices split over
TP, norms and row-parallel biases replicated, embedding on the first stage, final norm and output
layer on the last (a tied output layer is a copy of the embedding there when PP > 1).
"""

from __future__ import annotations

import dataclasses

from megatron_gndpo.config.schema import Config, ModelConfig, ParallelConfig
from megatron_gndpo.config.validate import layout_of
from megatron_gndpo.parallel.groups import ParallelLayout


def _norm_params(model: ModelConfig, width: int) -> int:
    return width * (2 if model.normalization == "LayerNorm" else 1)


def layer_params(model: ModelConfig, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank."""
    h, hd = model.hidden_size, model.head_dim
    qkv_rows = (model.num_attention_heads + 2 * model.query_groups) * hd // tp
    fc1_rows = model.ffn_hidden_size * (2 if model.swiglu else 1) // tp
    has_qkv_bias = model.add_qkv_bias or model.add_bias_linear
    attention = (
        qkv_rows * h
        + (qkv_rows if has_qkv_bias else 0)
        + h * (model.num_attention_heads * hd // tp)
        + (h if model.add_bias_linear else 0)
        + (2 * _norm_params(model, hd) if model.qk_layernorm else 0)
    )
    mlp = (
        fc1_rows * h
        + (fc1_rows if model.add_bias_linear else 0)
        + h * (model.ffn_hidden_size // tp)
        + (h if model.add_bias_linear else 0)
    )
    return 2 * _norm_params(model, h) + attention + mlp


def stage_params(model: ModelConfig, layout: ParallelLayout, stage: int) -> int:
    """Parameters held by each rank of pipeline stage ``stage``."""
    tp, pp = layout.tp, layout.pp
    vocab_shard = model.padded_vocab_size(tp) // tp * model.hidden_size
    total = layer_params(model, tp) * (model.num_layers // pp)
    if stage == 0:
        total += vocab_shard
        if model.position_embedding == "learned_absolute":
            total += model.max_position_embeddings * model.hidden_size
    if stage == pp - 1:
        total += _norm_params(model, model.hidden_size)
        if not model.tie_embeddings or pp > 1:
            total += vocab_shard
    return total


def total_params(model: ModelConfig) -> int:
    """Unique parameters of the whole model (vocabulary unpadded, tied output counted once)."""
    unpadded = dataclasses.replace(model, make_vocab_size_divisible_by=1)
    layout = ParallelLayout(world_size=1)
    return stage_params(unpadded, layout, 0)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stage: int
    first_layer: int
    last_layer: int
    params_per_rank: int
    ranks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    name: str
    layout: ParallelLayout
    total_params: int
    padded_vocab: int
    stages: tuple[StagePlan, ...]


def plan_model(name: str, model: ModelConfig, parallel: ParallelConfig, world: int) -> ModelPlan:
    layout = layout_of(parallel, world)
    per_stage = model.num_layers // layout.pp
    stages = []
    for stage in range(layout.pp):
        ranks = tuple(r for r in range(world) if layout.coords(r)["pp"] == stage)
        stages.append(
            StagePlan(
                stage=stage,
                first_layer=stage * per_stage,
                last_layer=(stage + 1) * per_stage - 1,
                params_per_rank=stage_params(model, layout, stage),
                ranks=ranks,
            )
        )
    return ModelPlan(
        name=name,
        layout=layout,
        total_params=total_params(model),
        padded_vocab=model.padded_vocab_size(layout.tp),
        stages=tuple(stages),
    )


def plan(cfg: Config, world_size: int) -> tuple[ModelPlan, ModelPlan]:
    """Plans of the student and the teacher (validate the config first)."""
    return (
        plan_model("student", cfg.model, cfg.parallel, world_size),
        plan_model("teacher", cfg.teacher.model, cfg.teacher.parallel, world_size),
    )


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) <= 8:
        return ",".join(map(str, ranks))
    return f"{','.join(map(str, ranks[:4]))},...,{ranks[-1]} ({len(ranks)} ranks)"


def format_model_plan(mp: ModelPlan, *, per_rank: bool = False) -> str:
    lay = mp.layout
    lines = [
        f"{mp.name}: {lay.describe()}  params {_human(mp.total_params)} "
        f"({mp.total_params:,}), vocab padded to {mp.padded_vocab}",
        f"  {'stage':>5}  {'layers':>9}  {'params/rank':>14}  ranks",
    ]
    for st in mp.stages:
        lines.append(
            f"  {st.stage:>5}  {st.first_layer:>4}-{st.last_layer:<4}  "
            f"{st.params_per_rank:>14,}  {_ranks_text(st.ranks)}"
        )
    samples = {
        "TP group of rank 0": lay.group_of(0, ("tp",)),
        "DPxCP group of rank 0 (GNDPO statistics)": lay.group_of(0, ("cp", "dp")),
        "PP group of rank 0": lay.group_of(0, ("pp",)),
    }
    for label, ranks in samples.items():
        lines.append(f"  {label}: [{_ranks_text(tuple(ranks))}]")
    if per_rank:
        lines.append(f"  {'rank':>5}  {'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3}  params")
        for r in range(lay.world_size):
            c = lay.coords(r)
            params = mp.stages[c["pp"]].params_per_rank
            lines.append(
                f"  {r:>5}  {c['tp']:>3} {c['cp']:>3} {c['dp']:>4} {c['pp']:>3}  {params:,}"
            )
    return "\n".join(lines)
