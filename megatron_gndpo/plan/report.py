"""What ``megatron-gndpo plan`` prints: the layouts, the memory table and its warnings, the step
time."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_gndpo.config.schema import Config
from megatron_gndpo.plan.hardware import RESERVED_FRACTION, Hardware, gib
from megatron_gndpo.plan.layout import ModelPlan
from megatron_gndpo.plan.memory import LOGPROB_CHUNK_TOKENS, RankMemory, sequence_length
from megatron_gndpo.plan.step_time import StepTime

# `plan --ranks` prints a line per rank; everything else takes time independent of the world size.
MAX_LISTED_RANKS = 65536


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _ranks_text(ranks: Sequence[int]) -> str:
    if len(ranks) <= 8:
        return ",".join(map(str, ranks))
    return f"{','.join(map(str, ranks[:4]))},...,{ranks[-1]} ({len(ranks)} ranks)"


def format_model_plan(mp: ModelPlan, *, per_rank: bool = False) -> str:
    lay = mp.layout
    moe = any(st.expert_params_per_rank for st in mp.stages)
    expert_head = f"  {'experts/rank':>14}" if moe else ""
    lines = [
        f"{mp.name}: {lay.describe()}  params {_human(mp.total_params)} "
        f"({mp.total_params:,}), vocab padded to {mp.padded_vocab}",
        f"  {'stage':>5}  {'layers':>9}  {'params/rank':>14}{expert_head}  ranks",
    ]
    for st in mp.stages:
        experts = f"  {st.expert_params_per_rank:>14,}" if moe else ""
        lines.append(
            f"  {st.stage:>5}  {st.first_layer:>4}-{st.last_layer:<4}  "
            f"{st.params_per_rank:>14,}{experts}  {_ranks_text(st.ranks)}"
        )
    samples = {  # ranges: as many ranks as the world, in constant time
        "TP group of rank 0": lay.group_range(0, ("tp",)),
        "DPxCP group of rank 0 (GNDPO statistics)": lay.group_range(0, ("cp", "dp")),
        "PP group of rank 0": lay.group_range(0, ("pp",)),
    }
    if moe:
        samples |= {
            "EP group of rank 0 (experts split)": lay.group_range(0, ("ep",)),
            "EDP group of rank 0 (expert gradients)": lay.group_range(0, ("edp",)),
        }
    for label, ranks in samples.items():
        lines.append(f"  {label}: [{_ranks_text(ranks)}]")
    if per_rank:
        lines.append(f"  {'rank':>5}  {'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3}  params")
        for r in range(lay.world_size):
            c = lay.coords(r)
            params = mp.stages[c["pp"]].params_per_rank
            lines.append(
                f"  {r:>5}  {c['tp']:>3} {c['cp']:>3} {c['dp']:>4} {c['pp']:>3}  {params:,}"
            )
    return "\n".join(lines)


# What to change when a component is the largest part of a rank that does not fit.
_FIXES = {
    "weights": "raise parallel.tensor_parallel or parallel.pipeline_parallel",
    "grads": "raise parallel.tensor_parallel or parallel.pipeline_parallel",
    "optimizer": "keep optimizer.use_distributed_optimizer on and raise the data-parallel size",
    "teacher": "raise teacher.parallel.tensor_parallel or teacher.parallel.pipeline_parallel",
    "rollout": "lower rollout.gpu_memory_utilization (vLLM), or rows per rank / "
    "rollout.max_response_length (built-in KV cache)",
    "scoring": "lower trainer.scoring_token_budget",
    "training": "lower trainer.micro_batch_size, set parallel.sequence_parallel=true, or raise "
    "parallel.tensor_parallel / pipeline_parallel",
}


def _teacher_part(r: RankMemory) -> str:
    return f" / teacher stage {r.teacher_stage}" if r.teacher_stages else ""


def fit_warnings(rows: list[RankMemory], hw: Hardware) -> list[str]:
    """One WARNING line per (student stage, teacher stage) whose peak exceeds the usable memory."""
    out = []
    for r in rows:
        if r.peak <= hw.usable_bytes:
            continue
        parts = {
            "weights": r.weights, "grads": r.grads, "optimizer": r.optimizer,
            "teacher": r.teacher_weights, r.peak_phase: r.phases[r.peak_phase],
        }  # fmt: skip
        biggest = max(parts, key=lambda name: parts[name])
        out.append(
            f"WARNING: ranks of student stage {r.stage}{_teacher_part(r)} need "
            f"{gib(r.peak)} GiB at their {r.peak_phase} peak, more than the "
            f"{gib(hw.usable_bytes)} GiB usable of a {hw.gpu_memory_gib:g} GiB GPU; the largest "
            f"part is {biggest} ({gib(parts[biggest])} GiB): {_FIXES[biggest]}"
        )
    return out


def format_memory(cfg: Config, rows: list[RankMemory], hw: Hardware) -> str:
    seq = sequence_length(cfg)
    engine = cfg.rollout.engine
    lines = [
        f"memory per rank, GiB ({hw.gpu_memory_gib:g} GiB GPU, {gib(hw.usable_bytes)} usable "
        f"after {RESERVED_FRACTION:.0%} for CUDA context, NCCL and fragmentation); rows of "
        f"{seq} tokens, micro-batch {cfg.trainer.micro_batch_size}, scoring micro-batch "
        f"{max(cfg.trainer.scoring_token_budget, seq)} tokens, rollout engine {engine}",
        f"  {'stage s/t':>9} | {'weights':>7} {'grads':>6} {'optim':>6} {'teacher':>7} | "
        f"{'rollout':>7} {'scoring':>7} {'training':>8} | {'peak':>6}  phase",
    ]
    for r in rows:
        lines.append(
            f"  {f'{r.stage}/{r.teacher_stage}' if r.teacher_stages else f'{r.stage}/-':>9} | "
            f"{gib(r.weights):>7} {gib(r.grads):>6} "
            f"{gib(r.optimizer):>6} {gib(r.teacher_weights):>7} | {gib(r.rollout):>7} "
            f"{gib(r.scoring):>7} {gib(r.training):>8} | {gib(r.peak):>6}  {r.peak_phase}"
        )
    lines += [
        "  weights: params dtype; grads: fp32 DDP buffer; optim: fp32 master + Adam moments / "
        "(DP*CP); teacher: its weights on its own layout",
        "  rollout: "
        + (
            "vLLM's gpu_memory_utilization share"
            if engine == "vllm"
            else "KV cache of this DP rank's rows at full length + one prefill layer"
        )
        + "; scoring: one forward layer + log-prob chunk; training: activations "
        "(Korthikanti et al. 2022, no recompute) of the 1F1B micro-batches in flight + log-prob "
        f"head ({LOGPROB_CHUNK_TOKENS}-token chunks)",
        "  peak = weights + grads + optim + teacher + the largest phase",
    ]
    return "\n".join(lines)


def format_step_time(st: StepTime, world_size: int, hw: Hardware) -> str:
    return "\n".join([
        f"step time at MFU {hw.mfu:g} of {hw.peak_flops / 1e12:g} TFLOP/s per GPU on "
        f"{world_size} GPUs, every row at full length ({st.tokens:,} tokens; an upper bound):",
        f"  rollout   {st.rollout_s:8.1f} s  (2N FLOPs/token: {st.generation_flops_s:.1f} s; "
        f"decode floor, weights + KV cache read at {hw.hbm_bytes_per_s / 1e12:g} TB/s per step: "
        f"{st.decode_floor_s:.1f} s)",
        f"  scoring   {st.scoring_s:8.1f} s  (teacher + student forward, 2N FLOPs/token each; "
        "several teachers: the costliest)",
        f"  training  {st.training_s:8.1f} s  (6N FLOPs/token)",
        f"  total     {st.total_s:8.1f} s per step, {st.tokens / st.total_s:,.0f} tokens/s",
    ])  # fmt: skip
