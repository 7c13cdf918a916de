"""Tests of megatron_gndpo.logging: sinks, the metrics logger, stage timers, FLOPs and MFU.

W&B runs offline (or disabled) with every directory under tmp_path and its server address set
to a closed local port, so nothing here can reach the network.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.config.schema import LoggingConfig, ModelConfig
from megatron_gndpo.logging import (
    CONSOLE_KEYS,
    ConsoleSink,
    JsonlSink,
    MetricsLogger,
    StageTimer,
    TensorBoardSink,
    WandbSink,
    attention_seq_len,
    build_logger,
    format_console_line,
    gpt_flops_per_token,
    mfu,
    model_flops_per_token,
    peak_flops_for,
    progress,
    wandb_mode,
)
from megatron_gndpo.logging import sinks as sinks_module

HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Parse strictly: NaN / Infinity literals are not JSON and must not appear."""

    def reject(constant: str) -> None:
        raise AssertionError(f"non-JSON constant {constant} in {path}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


@pytest.fixture
def wandb_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """W&B offline, silent, every directory under tmp_path, no key, server unreachable."""
    home = tmp_path / "wandb_home"
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


# ---------------------------------------------------------------- JSONL


def test_jsonl_records_and_non_finite_values(tmp_path: Path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLogger([JsonlSink(path)], enabled=True) as metrics:
        metrics.log(
            1,
            {
                "loss": 0.5,
                "tokens/global": 12,
                "skipped": False,
                "grad_norm": torch.tensor(2.0),
                "a": math.nan,
                "b": math.inf,
                "c": -math.inf,
            },
        )
        # Flushed at once: readable before close.
        assert read_jsonl(path)[0]["loss"] == 0.5
        metrics.log(2, {"loss": 0.25})
    records = read_jsonl(path)
    assert records == [
        {
            "step": 1,
            "loss": 0.5,
            "tokens/global": 12,
            "skipped": False,
            "grad_norm": 2.0,
            "a": "nan",
            "b": "inf",
            "c": "-inf",
        },
        {"step": 2, "loss": 0.25},
    ]
    assert next(iter(records[0])) == "step"
    with pytest.raises(RuntimeError, match="after close"):
        metrics.log(3, {"loss": 0.1})


def test_jsonl_rejects_step_key_and_non_numbers(tmp_path: Path) -> None:
    metrics = MetricsLogger([JsonlSink(tmp_path / "m.jsonl")], enabled=True)
    with pytest.raises(ValueError, match="reserved"):
        metrics.log(1, {"step": 3.0})
    with pytest.raises(TypeError, match="'name' is a str"):
        metrics.log(1, {"name": "x"})
    metrics.close()


def test_jsonl_truncate_after_for_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in range(1, 6):
        sink.log(step, {"loss": float(step)})
    sink.close()
    # A restart from the checkpoint at step 3: steps 4 and 5 are logged again.
    metrics = MetricsLogger([JsonlSink(path)], enabled=True)
    metrics.truncate_after(3)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    metrics.log(4, {"loss": 40.0})
    metrics.close()
    assert [(r["step"], r["loss"]) for r in read_jsonl(path)] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]
    assert not path.with_name(path.name + ".tmp").exists()


def test_jsonl_drops_partial_line_and_warns_on_repeated_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')  # crash mid-write
    sink = JsonlSink(path)
    with caplog.at_level(logging.WARNING):
        sink.log(2, {"loss": 2.0})
        sink.log(1, {"loss": 9.0})  # resumed without truncate_after
    sink.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 1]
    assert "incomplete last line" in caplog.text
    assert "truncate_after" in caplog.text


def test_truncate_after_without_a_file_is_a_no_op(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "missing.jsonl")
    sink.truncate_after(10)
    assert not (tmp_path / "missing.jsonl").exists()


# ---------------------------------------------------------------- console


FULL_STEP = {
    "time/step": 3.2149,
    "mfu": 0.41234,
    "tokens/s": 12345.6,
    "response_length/mean": 812.5,
    "clip/frac": 0.0123,
    "advantage/std": 1.0,
    "score/std": 0.8731,
    "score/mean": -0.41,
    "grad_norm/spikes": 2.0,
    "grad_norm/clip_active_frac": 0.25,
    "score/rms": 1.912,
    "grad_norm": 1.53,
    "loss": 0.123456,
    "ratio/mean": 1.0001,  # not a console key
}


def test_console_line_has_key_numbers_in_fixed_order() -> None:
    line = format_console_line(12, FULL_STEP)
    assert line == (
        "step 12 | loss 0.1235 | grad_norm 1.53 | score/rms 1.912 | "
        "grad_norm/clip_active_frac 0.25 | grad_norm/spikes 2 | score/mean -0.41 | "
        "score/std 0.8731 | "
        "advantage/std 1 | clip/frac 0.0123 | response_length/mean 812.5 | tokens/s 12346 | "
        "mfu 41.2% | time/step 3.21s"
    )
    assert format_console_line(3, {"loss": math.nan, "tokens/global": 7}) == "step 3 | loss nan"
    assert len(CONSOLE_KEYS) == 13


def test_console_sink_prints_every_n_steps(capsys: pytest.CaptureFixture[str]) -> None:
    sink = ConsoleSink(every=2)
    for step in range(1, 5):
        sink.log(step, {"loss": 1.0 / step})
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 2 | loss 0.5", "step 4 | loss 0.25"]
    stream = io.StringIO()
    ConsoleSink(stream=stream).log(1, {"grad_norm": 2.0})
    assert stream.getvalue() == "step 1 | grad_norm 2\n"
    with pytest.raises(ValueError, match="at least 1"):
        ConsoleSink(every=0)


# ---------------------------------------------------------------- disabled ranks


def test_disabled_logger_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_wandb(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("W&B must not start on a rank that does not log")

    monkeypatch.setattr(sinks_module, "WandbSink", no_wandb)
    run_dir = tmp_path / "run"
    cfg = LoggingConfig(run_dir=str(run_dir), wandb_project="p")
    metrics = build_logger(cfg, enabled=False, config_dict={})
    metrics.log(1, FULL_STEP)
    metrics.truncate_after(0)
    metrics.close()
    # Sinks handed to a disabled logger are dropped unused, too.
    path = tmp_path / "m.jsonl"
    MetricsLogger([JsonlSink(path), ConsoleSink()], enabled=False).log(1, {"loss": 1.0})
    assert not run_dir.exists()
    assert not path.exists()
    assert capsys.readouterr().out == ""


def test_build_logger_console_and_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = LoggingConfig(run_dir=str(tmp_path / "run"), log_interval=2)
    with build_logger(cfg, enabled=True, config_dict={}) as metrics:
        assert [type(s) for s in metrics.sinks] == [ConsoleSink, JsonlSink]
        for step in (1, 2):
            metrics.log(step, {"loss": 0.5})
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert capsys.readouterr().out == "step 2 | loss 0.5\n"


# ---------------------------------------------------------------- W&B


def test_wandb_mode_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"  # the user's choice wins
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode() is None  # unknown here: W&B interprets it


def test_wandb_offline_run_writes_under_run_dir(wandb_env: Path) -> None:
    run_dir = wandb_env / "run"
    cfg = LoggingConfig(run_dir=str(run_dir), wandb_project="gndpo-test", wandb_run_name="t")
    metrics = build_logger(cfg, enabled=True, config_dict={"algorithm": {"kl_clip": 5.0}})
    wandb_sink = metrics.sinks[-1]
    assert isinstance(wandb_sink, WandbSink) and wandb_sink.active
    metrics.log(1, {"loss": 0.5, "score/mean": math.nan})
    metrics.log(2, {"loss": 0.25})
    metrics.close()
    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    assert len(run_id) == 8
    run_files = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(run_files) == 1 and run_files[0].stat().st_size > 0


def test_wandb_resume_reuses_the_stored_id(
    wandb_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = wandb_env / "run"
    run_dir.mkdir()
    (run_dir / "wandb_id.txt").write_text("resume01\n")
    calls: list[dict[str, Any]] = []

    class FakeRun:
        def log(self, metrics: dict[str, Any], step: int) -> None:
            calls.append({"step": step, **metrics})

        def finish(self) -> None:
            calls.append({"finished": True})

    def fake_init(**kwargs: Any) -> FakeRun:
        calls.append(kwargs)
        return FakeRun()

    import wandb

    monkeypatch.setattr(wandb, "init", fake_init)
    sink = WandbSink("p", None, run_dir, {"a": 1})
    sink.log(7, {"loss": 1.0})
    sink.close()
    init_kwargs, logged, finished = calls
    assert init_kwargs["id"] == "resume01" and init_kwargs["resume"] == "allow"
    assert init_kwargs["dir"] == str(run_dir) and init_kwargs["config"] == {"a": 1}
    assert init_kwargs["mode"] == "offline"  # from WANDB_MODE
    assert logged == {"step": 7, "loss": 1.0} and finished == {"finished": True}


def test_wandb_disabled_mode_works(wandb_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sink = WandbSink("p", "name", wandb_env / "run", {})
    sink.log(1, {"loss": 1.0})
    sink.close()
    assert not (wandb_env / "run" / "wandb").exists()


def test_wandb_failures_only_warn(
    wandb_env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import wandb

    def broken_init(**kwargs: Any) -> None:
        raise RuntimeError("no network")

    monkeypatch.setattr(wandb, "init", broken_init)
    cfg = LoggingConfig(run_dir=str(wandb_env / "run"), wandb_project="p")
    with caplog.at_level(logging.WARNING):
        metrics = build_logger(cfg, enabled=True, config_dict={})
        metrics.log(1, {"loss": 1.0})
        metrics.close()
    assert "wandb.init failed" in caplog.text and "no network" in caplog.text
    assert read_jsonl(wandb_env / "run" / "metrics.jsonl") == [{"step": 1, "loss": 1.0}]

    class FailingRun:
        def log(self, metrics: dict[str, Any], step: int) -> None:
            raise OSError("disk full")

        def finish(self) -> None:
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: FailingRun())
    sink = WandbSink("p", None, wandb_env / "run", {})
    with caplog.at_level(logging.WARNING):
        sink.log(3, {"loss": 1.0})
    assert not sink.active and "disk full" in caplog.text
    sink.log(4, {"loss": 1.0})
    sink.close()


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_missing_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import fail as if tensorboard were not installed,
    # so this runs where it is installed too (CI installs it).
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    cfg = LoggingConfig(run_dir=str(tmp_path / "run"), tensorboard=True)
    # Raised on every rank, so the ranks that do not log stop too.
    for enabled in (True, False):
        with pytest.raises(ImportError, match="pip install tensorboard"):
            build_logger(cfg, enabled=enabled, config_dict={})
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed")
def test_tensorboard_writes_event_files(tmp_path: Path) -> None:
    cfg = LoggingConfig(run_dir=str(tmp_path / "run"), tensorboard=True)
    with build_logger(cfg, enabled=True, config_dict={}) as metrics:
        metrics.log(1, {"loss": 0.5, "score/mean": math.nan})
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_sink_adds_each_scalar(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[Any, ...]] = []

    class FakeWriter:
        def __init__(self, log_dir: str) -> None:
            events.append(("open", log_dir))

        def add_scalar(self, tag: str, value: float, global_step: int) -> None:
            events.append((tag, value, global_step))

        def flush(self) -> None:
            events.append(("flush",))

        def close(self) -> None:
            events.append(("close",))

    monkeypatch.setattr(sinks_module, "require_tensorboard", lambda: FakeWriter)
    sink = TensorBoardSink(tmp_path / "tb")
    sink.log(5, {"loss": 0.5, "skipped": True})
    sink.close()
    assert events == [
        ("open", str(tmp_path / "tb")),
        ("loss", 0.5, 5),
        ("skipped", 1.0, 5),
        ("flush",),
        ("close",),
    ]


# ---------------------------------------------------------------- timers


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def test_stage_timer_nesting_accumulation_and_pop() -> None:
    clock = FakeClock()
    syncs: list[float] = []
    timer = StageTimer(sync=lambda: syncs.append(clock.now), clock=clock)
    with timer.time("step"):
        with timer.time("rollout"):
            clock.advance(2.0)
        with timer.time("update"):
            clock.advance(0.5)
            for _ in range(3):  # micro-batches accumulate
                with timer.time("update/forward_backward"):
                    clock.advance(1.0)
            with timer.time("update/optimizer"):
                clock.advance(0.25)
    assert timer.pop() == {
        "time/step": 5.75,
        "time/rollout": 2.0,
        "time/update": 3.75,
        "time/update/forward_backward": 3.0,
        "time/update/optimizer": 0.25,
    }
    assert len(syncs) == 2 * 7  # at both ends of each of the 7 stages entered
    assert timer.pop() == {}
    outer, inner_fails = timer.time("update"), pytest.raises(RuntimeError, match="already open")
    with outer, inner_fails, timer.time("update"):
        pass


def test_stage_timer_records_failed_stage_and_refuses_pop_inside_a_stage() -> None:
    clock = FakeClock()
    timer = StageTimer(clock=clock)
    with pytest.raises(KeyError), timer.time("teacher"):
        clock.advance(1.5)
        raise KeyError("boom")
    with timer.time("step"), pytest.raises(RuntimeError, match="inside stage 'step'"):
        timer.pop()
    assert timer.pop() == {"time/teacher": 1.5, "time/step": 0.0}
    with pytest.raises(ValueError, match="non-empty"), timer.time(""):
        pass


def test_stage_timer_measures_wall_time() -> None:
    timer = StageTimer()
    with timer.time("sleep"):
        sum(range(10_000))
    (seconds,) = timer.pop().values()
    assert 0.0 < seconds < 5.0


# ---------------------------------------------------------------- FLOPs and MFU


def hand_count_flops(
    layers: int,
    h: int,
    f: int,
    heads: int,
    groups: int,
    d: int,
    vocab: int,
    s: int,
    swiglu: bool,
) -> float:
    """Forward FLOPs per token from the GEMM shapes of one sequence of s tokens (2 per MAC),
    with the causal attention matrices counted half full."""
    gemms = [  # (rows, inner, cols) of each matrix product in one layer
        (s, h, heads * d),  # Q
        (s, h, groups * d),  # K
        (s, h, groups * d),  # V
        *[(s, d, s / 2)] * heads,  # scores, one per head, half of the s×s matrix
        *[(s / 2, s, d)] * heads,  # probabilities × values: each head's output, half the work
        (s, heads * d, h),  # output projection
        *[(s, h, f)] * (2 if swiglu else 1),  # gate (SwiGLU only) and up
        (s, f, h),  # down
    ]
    per_layer = sum(2 * m * k * n for m, k, n in gemms)
    logits = 2 * s * h * vocab
    return (layers * per_layer + logits) / s


@pytest.mark.parametrize("swiglu", [True, False])
def test_flops_match_hand_count_for_a_tiny_shape(swiglu: bool) -> None:
    shape = dict(layers=2, h=8, f=16, heads=2, groups=1, d=4, vocab=10, s=6)
    expected = hand_count_flops(**shape, swiglu=swiglu)
    assert expected == (2656 if swiglu else 2144)  # worked by hand: see the docstring's terms
    kwargs = dict(
        num_layers=2,
        hidden_size=8,
        ffn_hidden_size=16,
        num_attention_heads=2,
        num_query_groups=1,
        head_dim=4,
        vocab_size=10,
        seq_len=6,
        swiglu=swiglu,
    )
    assert gpt_flops_per_token(**kwargs, training=False) == pytest.approx(expected)
    assert gpt_flops_per_token(**kwargs, training=True) == pytest.approx(3 * expected)


@pytest.mark.parametrize(
    ("groups", "ffn", "vocab"),
    [(32, 11008, 32000), (8, 14336, 128256)],  # Llama-2-7B (MHA), Llama-3-8B (GQA)
)
def test_flops_match_six_n_for_a_big_shape(groups: int, ffn: int, vocab: int) -> None:
    layers, h, heads, d = 32, 4096, 32, 128
    # Matmul parameters: per layer Q, K, V, output projection and the 3 SwiGLU matrices, plus
    # the output layer (the input embedding is a lookup, not a matmul).
    params = layers * (h * heads * d + 2 * h * groups * d + heads * d * h + 3 * h * ffn)
    params += h * vocab
    flops = gpt_flops_per_token(layers, h, ffn, heads, groups, d, vocab, 512, True, training=True)
    # At 512 tokens attention adds about 1%.
    assert flops / (6 * params) == pytest.approx(1.0, rel=0.02)
    assert flops > 6 * params


def test_model_flops_per_token_uses_model_config_defaults() -> None:
    model = ModelConfig(
        num_layers=3, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, vocab_size=128
    )
    expected = gpt_flops_per_token(3, 64, 256, 4, 4, 16, 128, 100, True, training=True)
    assert model_flops_per_token(model, 100, training=True) == expected


def test_attention_seq_len_makes_batches_exact() -> None:
    lengths = [3, 10, 1, 7]
    shape = dict(
        num_layers=2,
        hidden_size=16,
        ffn_hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=4,
        vocab_size=50,
        swiglu=True,
        training=True,
    )
    per_sequence = sum(n * gpt_flops_per_token(**shape, seq_len=n) for n in lengths)
    batch = sum(lengths) * gpt_flops_per_token(**shape, seq_len=attention_seq_len(lengths))
    assert batch == pytest.approx(per_sequence)
    assert attention_seq_len([]) == 0.0


def test_mfu_and_peak_flops() -> None:
    assert mfu(989e12, 2.0, 989e12) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="seconds"):
        mfu(1.0, 0.0, 1.0)
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA H200") == 989e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("cpu") is None


# ---------------------------------------------------------------- progress


def test_progress_bar_shows_only_where_asked() -> None:
    stream = io.StringIO()
    with progress(3, "rollout", enabled=False, force=True, file=stream) as bar:
        bar.update(3)
    with progress(3, "rollout", enabled=True, file=stream) as bar:  # not a terminal
        bar.update(3)
    assert stream.getvalue() == ""
    with progress(3, "rollout", enabled=True, force=True, file=stream) as bar:
        bar.update(3)
    assert "rollout" in stream.getvalue()


def test_stdlib_logging_is_not_shadowed() -> None:
    assert logging.getLogger is not None and hasattr(logging, "WARNING")
    assert logging.__file__ is not None and "megatron_gndpo" not in logging.__file__
