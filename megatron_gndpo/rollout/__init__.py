"""Rollout engines behind one :class:`Generator` protocol (built-in megatron-core, vLLM)."""

from megatron_gndpo.rollout.base import Generator, Rollout, SamplingParams

__all__ = ["Generator", "Rollout", "SamplingParams"]
