"""Step time from model FLOPs at a stated MFU, generation bounded below by memory bandwidth."""

from __future__ import annotations

import dataclasses

from megatron_gndpo.config.schema import Config
from megatron_gndpo.logging.throughput import model_flops_per_token
from megatron_gndpo.parallel.groups import layout_of
from megatron_gndpo.plan.hardware import BYTES, DEFAULT_HARDWARE, Hardware
from megatron_gndpo.plan.layout import colocated_teachers
from megatron_gndpo.plan.memory import kv_cache_bytes, sequence_length
from megatron_gndpo.plan.params import total_params


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step's phases at the assumed MFU (all GPUs busy, no pipeline bubble)."""

    tokens: int  # rollout_batch_size · (max prompt + max response): every row at full length
    generation_flops_s: float  # 2·N per token (prefill and decode) at the MFU
    decode_floor_s: float  # each decode step reads the weights and the KV cache from HBM
    scoring_s: float  # teacher + student forward, 2·N per token each
    training_s: float  # 6·N per token

    @property
    def rollout_s(self) -> float:
        return max(self.generation_flops_s, self.decode_floor_s)

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.scoring_s + self.training_s


def generation_time(
    cfg: Config, rows: int, tp: int, ranks: int, hw: Hardware
) -> tuple[float, float]:
    """One model replica of ``ranks`` GPUs at ``tp`` generating ``rows`` rows: the FLOP time
    (2N per token of prompt and response at the MFU) and the decode floor (each of the
    max_response decode steps reads the weights and the KV cache, half full on average, split
    over the TP ranks; pipeline stages run one after another per token)."""
    model, seq = cfg.model, sequence_length(cfg)
    flops_s = model_flops_per_token(model, seq, training=False) * rows * seq
    flops_s /= ranks * hw.peak_flops * hw.mfu
    mean_positions = cfg.rollout.max_prompt_length + cfg.rollout.max_response_length / 2
    kv = kv_cache_bytes(model, 1, model.num_layers, rows, mean_positions)
    weights = total_params(model) * BYTES[model.params_dtype]
    per_decode_step = (weights + kv) / tp / hw.hbm_bytes_per_s
    return flops_s, cfg.rollout.max_response_length * per_decode_step


def estimate_step_time(cfg: Config, world_size: int, hw: Hardware = DEFAULT_HARDWARE) -> StepTime:
    """Step time with every one of ``world_size`` ranks generating, scoring and training in
    turn (colocated; rollout.disaggregate is not read here), from model FLOPs
    (logging/throughput.py) at ``hw.mfu`` of ``hw.peak_flops``.

    Generation is also bounded below by memory bandwidth (:func:`generation_time`).
    """
    seq = sequence_length(cfg)
    tokens = cfg.rollout.rollout_batch_size * seq
    student = cfg.model
    forward = model_flops_per_token(student, seq, training=False)
    training = model_flops_per_token(student, seq, training=True)
    # several teachers: each row is scored by one; the costliest bounds the step (all rows to it)
    # (a served teacher's forward runs on its server: not counted)
    scoring = forward + max(
        (model_flops_per_token(t.model, seq, training=False) for t in colocated_teachers(cfg)),
        default=0.0,
    )
    rate = world_size * hw.peak_flops * hw.mfu  # FLOP/s of the whole job
    layout = layout_of(cfg.parallel, world_size)
    rows = cfg.rollout.rollout_batch_size // layout.dp
    _, decode_floor = generation_time(cfg, rows, layout.tp, layout.tp, hw)
    return StepTime(
        tokens=tokens,
        generation_flops_s=forward * tokens / rate,
        decode_floor_s=decode_floor,
        scoring_s=scoring * tokens / rate,
        training_s=training * tokens / rate,
    )
