"""EndingWatch: one warning when no sampled response has stopped for a window of steps."""

from __future__ import annotations

from megatron_gndpo.config.schema import AlgorithmConfig
from megatron_gndpo.methods import build_method
from megatron_gndpo.rollout.metrics import EndingWatch


def _advice(estimator: str = "gndpo") -> str:
    return build_method(AlgorithmConfig(estimator=estimator)).never_stops_advice


def test_warns_once_after_a_window_of_unfinished_steps() -> None:
    watch = EndingWatch(limit=48, advice=_advice(), window=3)
    said = [watch.observe(f) for f in (0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)]
    assert [i for i, s in enumerate(said) if s is not None] == [5]  # the 3rd zero in a row
    assert "rollout.max_response_length=48" in str(said[5])
    assert "estimator=tropd" in str(said[5])


def test_a_stopping_student_is_never_warned_about() -> None:
    watch = EndingWatch(limit=24, advice=_advice(), window=2)
    assert all(watch.observe(f) is None for f in (0.0, 0.1, 0.0, 1.0, 0.0, 0.06))


def test_the_advice_fits_the_estimator() -> None:
    def said(estimator: str) -> str:
        watch = EndingWatch(limit=32, advice=_advice(estimator), window=1)
        return str(watch.observe(0.0))

    for estimator in ("gndpo", "opd", "vopd", "mix"):
        assert "estimator=tropd" in said(estimator) and "distillation score" in said(estimator)
    tropd = said("tropd")
    assert "estimator=tropd" not in tropd and "prefix_share_start" in tropd
    grpo = said("grpo")
    assert "distillation score" not in grpo and "reward" in grpo
    for text in (said("gndpo"), tropd, grpo):
        assert "rollout.max_response_length=32" in text and "rollout.stop_token_ids" in text
