"""The configuration: strict loading, errors that name the fix, cross-field validation, examples.

Every example under ``examples/`` is loaded and validated at the world size its header names
(``# megatron-gndpo plan -c examples/NAME.yaml -n N``), so a new example is checked as soon as it
is added, and an example without that line fails.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

from megatron_gndpo.checks import validate
from megatron_gndpo.config import (
    Config,
    ConfigError,
    check_environment,
    load_config,
    parse_overrides,
    save_resolved,
    to_dict,
    to_yaml,
)
from megatron_gndpo.config.loader import build
from tests.examples import EXAMPLES, EXAMPLES_DIR, example_world_size


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def config_error(*overrides: str, path: Path | None = None) -> str:
    """The message of the ConfigError that loading these overrides raises."""
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    return str(err.value)


def validation_error(world_size: int | None, *overrides: str) -> str:
    """The message of the ConfigError that validating the default plus overrides raises."""
    cfg = load_config(None, list(overrides))
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size)
    return str(err.value)


# --------------------------------------------------------------------------------------------
# Loading


@pytest.mark.parametrize("world_size", [None, 1, 8])
def test_embedded_default_loads_and_validates(world_size: int | None) -> None:
    cfg = load_config()
    assert cfg == Config()
    assert validate(cfg, world_size) is cfg


def test_yaml_and_overrides_give_typed_values(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        algorithm:
          kl_clip: 7.0
          policy_loss: ppo_clip
        rollout:
          prompts_per_step: 8
        """,
    )
    cfg = load_config(
        path,
        [
            "algorithm.kl_clip=3.0",
            "rollout.stop_token_ids=[1,2]",
            "teacher.parallel.tensor_parallel=2",
            "optimizer.lr=1e-6",  # YAML 1.1 reads this as the string "1e-6"
            "trainer.steps=7",
        ],
    )
    assert cfg.algorithm.kl_clip == 3.0 and type(cfg.algorithm.kl_clip) is float
    assert cfg.algorithm.policy_loss == "ppo_clip"  # from the file, not overridden
    assert cfg.rollout.prompts_per_step == 8
    assert cfg.rollout.stop_token_ids == (1, 2) and type(cfg.rollout.stop_token_ids) is tuple
    assert cfg.teacher.parallel.tensor_parallel == 2
    assert cfg.teacher.model == Config().teacher.model  # the rest of the section keeps defaults
    assert cfg.parallel.tensor_parallel == 1  # the student's layout is a different section
    assert cfg.optimizer.lr == 1e-6 and type(cfg.optimizer.lr) is float
    assert cfg.trainer.steps == 7 and type(cfg.trainer.steps) is int


def _alias_bomb(levels: int) -> str:
    """A YAML list of nested aliases: 9 ** (levels + 1) values in a few hundred bytes."""
    lists = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lists += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return f"[{', '.join(lists)}, 0]"


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path: Path) -> None:
    """Issue 48, probe 6: the type error quoted the expanded value (8 levels: a 351 MB message,
    1.55 GB of memory). A value in a message is cut short; YAML that expands past MAX_VALUES
    is refused before anything walks it."""
    path = write(tmp_path, f"trainer:\n  steps: {_alias_bomb(4)}\n")  # 59,049 values: allowed
    msg = config_error(path=path)
    assert msg.startswith("trainer.steps: expected an integer, got [[1, 1, 1, 1, ...], [[...], ")
    assert len(msg) < 200, msg
    path = write(tmp_path, f"trainer:\n  steps: {_alias_bomb(8)}\n", "bomb.yaml")
    assert config_error(path=path) == (
        f"{path} expands to more than 100,000 values (YAML anchors and aliases repeat what they "
        "name): no configuration is that large; write the values out"
    )
    msg = config_error(f"trainer.steps={_alias_bomb(8)}")
    assert msg.startswith("override 'trainer.steps' expands to more than 100,000 values")


@pytest.mark.parametrize(
    "override", ["optimizer.lr=nan", "algorithm.kl_clip=.inf", "algorithm.kl_clip=-1e400"]
)
def test_numbers_that_are_not_finite_are_refused_at_load(override: str) -> None:
    """Issue 48, probe 10: ``optimizer.lr=nan`` was torch's ValueError (31 lines) and
    ``algorithm.kl_clip=.inf`` passed validation to fail in step 1."""
    key, value = override.split("=")
    shown = {"nan": "nan", ".inf": "inf", "-1e400": "-1e400"}[value]
    assert config_error(override) == (
        f"{key}={shown}: expected a finite number (NaN and infinities are never a valid setting)"
    )


def test_part_of_the_teachers_model_keeps_the_teachers_own_defaults(tmp_path: Path) -> None:
    """Issue 48, probe 3: ``teacher.model.num_layers=8`` gave a teacher of the student's width
    (hidden 64, FFN 256) instead of the teacher's documented 128 / 512, without a word."""
    given = [
        load_config(None, ["teacher.model.num_layers=8"]).teacher.model,
        load_config(write(tmp_path, "teacher:\n  model:\n    num_layers: 8\n")).teacher.model,
        load_config(None, ["teachers=[{name: a, model: {num_layers: 8}}]"]).teachers[0].model,
    ]
    for model in given:
        assert (model.num_layers, model.hidden_size, model.ffn_hidden_size) == (8, 128, 512)


def test_float_field_accepts_an_integer_as_float() -> None:
    cfg = load_config(None, ["algorithm.kl_clip=3"])
    assert cfg.algorithm.kl_clip == 3.0 and type(cfg.algorithm.kl_clip) is float


def test_nullable_fields_accept_null_and_values() -> None:
    cfg = load_config(None, ["model.num_query_groups=2", "algorithm.dual_clip=null"])
    assert cfg.model.num_query_groups == 2
    assert cfg.algorithm.dual_clip is None
    assert load_config(None, ["algorithm.dual_clip=3"]).algorithm.dual_clip == 3.0


def test_configs_are_frozen() -> None:
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.algorithm.kl_clip = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.teacher = cfg.teacher  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.teacher.model.num_layers = 1  # type: ignore[misc]


def test_parse_overrides_nests_dotted_keys() -> None:
    assert parse_overrides(["a.b=1", "a.c.d=x", "--e=[1, 2]"]) == {
        "a": {"b": 1, "c": {"d": "x"}},
        "e": [1, 2],
    }


# --------------------------------------------------------------------------------------------
# Errors that name the problem and the fix


def test_unknown_top_level_key_in_yaml_suggests_the_right_one(tmp_path: Path) -> None:
    path = write(tmp_path, "algorithmm:\n  kl_clip: 3.0\n")
    msg = config_error(path=path)
    assert "unknown key algorithmm" in msg
    assert "did you mean algorithm?" in msg


def test_unknown_nested_key_in_yaml_suggests_the_right_one(tmp_path: Path) -> None:
    path = write(tmp_path, "teacher:\n  model:\n    num_layer: 3\n")
    msg = config_error(path=path)
    assert "unknown key teacher.model.num_layer" in msg
    assert "did you mean teacher.model.num_layers?" in msg


def test_unknown_top_level_key_in_override_suggests_the_right_one() -> None:
    msg = config_error("rolout.temperature=0.7")
    assert "unknown key rolout" in msg
    assert "did you mean rollout?" in msg


def test_unknown_nested_key_in_override_suggests_the_right_one() -> None:
    msg = config_error("algorithm.kl_clp=3.0")
    assert "unknown key algorithm.kl_clp" in msg
    assert "did you mean algorithm.kl_clip?" in msg
    assert "kl_clip, policy_loss" in msg  # and it lists the section's keys


def test_unknown_key_without_a_close_match_lists_the_section_keys() -> None:
    msg = config_error("trainer.zzzz=1")
    assert "unknown key trainer.zzzz" in msg
    assert "did you mean" not in msg
    assert "keys of trainer: steps, seed, micro_batch_size" in msg


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("trainer.steps=ten", "trainer.steps", "expected an integer"),  # string for int
        ("parallel.sequence_parallel=1", "parallel.sequence_parallel", "expected true/false"),
        ("trainer.steps=1.5", "trainer.steps", "expected an integer"),  # float for int
        ("trainer.micro_batch_size=true", "trainer.micro_batch_size", "expected an integer"),
        ("algorithm.kl_clip=abc", "algorithm.kl_clip", "expected a number"),
        ("model.params_dtype=fp64", "model.params_dtype", "one of 'fp32', 'bf16', 'fp16'"),
        ("rollout.stop_token_ids=3", "rollout.stop_token_ids", "a list of an integer"),
        ("rollout.stop_token_ids=[1,x]", "rollout.stop_token_ids[1]", "expected an integer"),
        ("data.tokenizer=12", "data.tokenizer", "a string or null"),
    ],
)
def test_wrong_type_names_the_key_and_expected_type(override: str, key: str, expected: str) -> None:
    msg = config_error(override)
    assert msg.startswith(f"{key}: ")
    assert expected in msg


def test_scalar_for_a_section_is_an_error() -> None:
    msg = config_error("teacher.model=3")
    assert "teacher.model is a section" in msg
    assert "expected a mapping" in msg


def test_list_where_a_mapping_is_expected_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "rollout:\n  - prompts_per_step: 4\n")
    msg = config_error(path=path)
    assert "rollout is a section" in msg
    assert "expected a mapping" in msg
    # The whole file must be a mapping of sections too.
    path = write(tmp_path, "- model\n- rollout\n", name="list.yaml")
    msg = config_error(path=path)
    assert "must hold a mapping of sections" in msg
    assert "list" in msg


def test_key_set_twice_in_yaml_names_both_lines_and_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        algorithm:
          kl_clip: 3.0
          policy_loss: gspo
          kl_clip: 4.0
        """,
    )
    msg = config_error(path=path)
    assert "'kl_clip' is set twice" in msg
    assert "lines 2 and 4" in msg
    assert str(path) in msg
    assert "keep one" in msg


def test_section_set_twice_in_yaml_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer:\n  steps: 1\nrollout:\n  top_k: 2\ntrainer:\n  seed: 3\n")
    msg = config_error(path=path)
    assert "'trainer' is set twice" in msg
    assert "lines 1 and 5" in msg


def test_key_given_twice_among_overrides() -> None:
    msg = config_error("algorithm.kl_clip=3.0", "trainer.steps=2", "algorithm.kl_clip=4.0")
    assert "'algorithm.kl_clip' is given twice" in msg
    assert "keep one" in msg


def test_conflicting_overrides_of_a_section_and_its_key() -> None:
    for order in (
        ("algorithm=3", "algorithm.kl_clip=1.0"),
        ("algorithm.kl_clip=1.0", "algorithm=3"),
    ):
        msg = config_error(*order)
        assert "conflicts" in msg and "algorithm" in msg


@pytest.mark.parametrize("override", ["algorithm.kl_clip", "=3", "algorithm.kl_clip:3"])
def test_malformed_override_shows_the_expected_form(override: str) -> None:
    msg = config_error(override)
    assert repr(override) in msg
    assert "section.key=value" in msg
    assert "algorithm.kl_clip=3.0" in msg  # an example of the right form


def test_override_value_that_is_not_yaml() -> None:
    msg = config_error("rollout.stop_token_ids=[1,2")
    assert "rollout.stop_token_ids" in msg
    assert "not valid YAML" in msg


def test_invalid_yaml_file_names_the_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "trainer:\n  steps: [1, 2\n")
    msg = config_error(path=path)
    assert f"{path} is not valid YAML" in msg
    assert f'"{path}", line' in msg  # the parser's mark names the file, not "<unicode string>"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    msg = config_error(path=path)
    assert str(path) in msg
    assert "does not exist" in msg


def test_empty_file_is_an_error_and_braces_are_the_default(tmp_path: Path) -> None:
    # An empty file is almost always the wrong file (issue 15), not "every default".
    with pytest.raises(ConfigError, match=r"run\.yaml is empty .*`\{\}` to mean every default"):
        load_config(write(tmp_path, "# nothing set\n"))
    assert load_config(write(tmp_path, "{}  # every default\n")) == Config()


# --------------------------------------------------------------------------------------------
# Cross-field validation


def test_student_layout_not_dividing_the_world() -> None:
    msg = validation_error(8, "parallel.tensor_parallel=3")
    assert "parallel: tensor_parallel (3)" in msg
    assert "does not divide the world size 8" in msg
    assert "teacher.parallel:" not in msg


def test_teacher_layout_not_dividing_the_world() -> None:
    msg = validation_error(
        8, "teacher.parallel.pipeline_parallel=2", "teacher.parallel.context_parallel=3"
    )
    assert (
        "teacher.parallel: tensor_parallel (1) x pipeline_parallel (2) x context_parallel (3)"
        in msg
    )
    assert "does not divide the world size 8" in msg
    assert "\n  - parallel:" not in msg  # the student's layout is fine


def test_layout_is_only_checked_with_a_world_size() -> None:
    cfg = load_config(
        None,
        [
            "parallel.tensor_parallel=3",
            "model.num_attention_heads=3",
            "model.hidden_size=63",
            "model.ffn_hidden_size=252",
            "model.num_query_groups=3",
        ],
    )
    validate(cfg)  # no world size: nothing to divide
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        validate(cfg, 4)


def test_rollout_batch_not_divisible_by_data_parallel_size() -> None:
    msg = validation_error(8, "rollout.prompts_per_step=3", "rollout.samples_per_prompt=3")
    assert "rollout.prompts_per_step (3)" in msg
    assert "data-parallel size 8" in msg
    assert "make it a multiple of 8" in msg


def test_per_rank_batch_not_splitting_into_mini_and_micro_batches() -> None:
    # 2 x 4 = 8 sequences over DP=2: 4 per rank, which 3 optimizer steps x 1 cannot split.
    msg = validation_error(
        2,
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "trainer.optimizer_steps_per_rollout=3",
    )
    assert "holds 4 sequences per step" in msg
    assert "trainer.optimizer_steps_per_rollout (3)" in msg
    assert "trainer.micro_batch_size (1)" in msg
    assert "make 4 a multiple of 3" in msg
    # and micro batches: 2 steps x micro-batch 4 = 8 does not divide 4 either
    msg = validation_error(
        2,
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4",
        "trainer.optimizer_steps_per_rollout=2",
        "trainer.micro_batch_size=4",
    )
    assert "make 4 a multiple of 8" in msg
    validate(
        load_config(
            None,
            [
                "rollout.prompts_per_step=2",
                "rollout.samples_per_prompt=4",
                "trainer.optimizer_steps_per_rollout=2",
                "trainer.micro_batch_size=2",
            ],
        ),
        2,
    )


@pytest.mark.parametrize(
    ("override", "key", "choices"),
    [
        ("algorithm.estimator=ppo", "algorithm.estimator", "gndpo"),
        ("algorithm.policy_loss=dpo", "algorithm.policy_loss", "gspo"),
        ("algorithm.aggregation=sum", "algorithm.aggregation", "token-mean"),
    ],
)
def test_unknown_algorithm_names(override: str, key: str, choices: str) -> None:
    msg = validation_error(None, override)
    value = override.split("=")[1]
    assert f"{key}: unknown name {value!r}" in msg
    assert "use one of" in msg and choices in msg


@pytest.mark.parametrize("key", ["kl_clip", "clip_low", "clip_high"])
@pytest.mark.parametrize("value", ["0", "-0.1"])
def test_clip_ranges_must_be_positive(key: str, value: str) -> None:
    msg = validation_error(None, f"algorithm.{key}={value}")
    assert f"algorithm.{key} must be > 0, got {float(value)}" in msg


@pytest.mark.parametrize("value", ["1.0", "0.5"])
def test_dual_clip_must_exceed_one(value: str) -> None:
    msg = validation_error(None, "algorithm.policy_loss=ppo_clip", f"algorithm.dual_clip={value}")
    assert f"algorithm.dual_clip must be > 1 (or null to disable it), got {float(value)}" in msg
    validate(load_config(None, ["algorithm.policy_loss=ppo_clip", "algorithm.dual_clip=3.0"]))


@pytest.mark.parametrize(
    "sampling",
    [
        ["rollout.temperature=0.7"],
        ["rollout.top_p=0.9"],
        ["rollout.top_k=20"],
        ["rollout.outlier_interval=2", "rollout.outlier_temperature=1.5"],
    ],
)
def test_offpolicy_correction_needs_the_unmodified_distribution(sampling: list[str]) -> None:
    msg = validation_error(None, "algorithm.offpolicy.correction=tis", *sampling)
    assert "algorithm.offpolicy.correction=tis needs the sampler's log-probs" in msg
    assert sampling[-1] in msg and "rollout.temperature=1, top_p=1, top_k=0" in msg
    assert "or set correction=none" in msg
    validate(load_config(None, sampling))  # without a correction any sampling is fine


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "algorithm.offpolicy.tis_cap=0.9",
            "algorithm.offpolicy: tis_cap must be a finite number >= 1",
        ),
        ("algorithm.offpolicy.mask_low=1.5", "algorithm.offpolicy: the mask interval"),
        ("algorithm.offpolicy.mask_high=0.8", "must contain 1"),
    ],
)
def test_offpolicy_bounds(override: str, needle: str) -> None:
    assert needle in validation_error(None, "algorithm.offpolicy.correction=mask", override)
    msg = config_error("algorithm.offpolicy.correction=clip")
    assert "algorithm.offpolicy.correction" in msg and "tis" in msg
    for ok in ("tis", "mask"):
        for level in ("token", "sequence", "geometric"):
            validate(load_config(None, [f"algorithm.offpolicy.correction={ok}",
                                        f"algorithm.offpolicy.level={level}"]))  # fmt: skip


def test_rollout_filter_rules() -> None:
    zero = "algorithm.filter.drop_zero_variance_groups=true"
    msg = validation_error(None, zero)  # the default estimator, gndpo, has no reward
    assert "drop_zero_variance_groups drops prompt groups whose verifiable rewards" in msg
    assert "algorithm.estimator=gndpo does not train on the reward" in msg
    assert "(grpo, reinforce_pp, mix, tgpo) or turn the filter off" in msg
    msg = validation_error(None, zero, "algorithm.estimator=reinforce_pp",
                           "rollout.samples_per_prompt=1")  # fmt: skip
    assert "rollout.samples_per_prompt must be >= 2, got 1" in msg
    assert "does not train on the reward" not in msg
    msg = validation_error(None, "algorithm.filter.min_response_tokens=4097",
                           "rollout.max_response_length=4096")  # fmt: skip
    assert "min_response_tokens=4097 exceeds rollout.max_response_length=4096" in msg
    assert "min_response_tokens must be >= 0" in validation_error(
        None, "algorithm.filter.min_response_tokens=-1"
    )
    for estimator in ("grpo", "reinforce_pp", "tgpo"):
        validate(load_config(None, [zero, f"algorithm.estimator={estimator}"]))
    mix = ["algorithm.estimator=mix", "algorithm.outcome_weight=0.5"]
    validate(load_config(None, [zero, *mix]))
    validate(load_config(None, ["algorithm.filter.drop_truncated=true",
                                "algorithm.filter.min_response_tokens=1"]))  # fmt: skip


def test_heads_not_divisible_by_tensor_parallel() -> None:
    msg = validation_error(8, "parallel.tensor_parallel=8")  # the default student has 4 heads
    assert "parallel.tensor_parallel=8 must divide model.num_attention_heads (4)" in msg
    assert "lower tensor_parallel" in msg
    msg = validation_error(8, "teacher.parallel.tensor_parallel=8")
    assert "teacher.parallel.tensor_parallel=8 must divide teacher.model.num_attention_heads" in msg


def test_layers_not_divisible_by_pipeline_parallel() -> None:
    msg = validation_error(2, "model.num_layers=3", "parallel.pipeline_parallel=2")
    assert "parallel.pipeline_parallel=2 must divide model.num_layers (3)" in msg
    msg = validation_error(8, "teacher.parallel.pipeline_parallel=8")  # the teacher has 4 layers
    assert "teacher.parallel.pipeline_parallel=8 must divide teacher.model.num_layers (4)" in msg


def test_teacher_vocabulary_smaller_than_the_students() -> None:
    msg = validation_error(None, "model.vocab_size=152064", "teacher.model.vocab_size=151936")
    assert "teacher.model.vocab_size (151936) is smaller than" in msg
    assert "(152064)" in msg
    assert "set data.vocab_size" in msg  # the escape hatch is named


def test_data_vocab_size_restricts_both_models_to_the_tokenizer() -> None:
    # Qwen2.5: the 1.5B has 151936 embedding rows, the 7B 152064, the tokenizer 151665 ids.
    base = ["model.vocab_size=151936", "teacher.model.vocab_size=152064"]
    validate(load_config(None, [*base, "data.vocab_size=151665"]), 8)
    validate(load_config(None, base), 8)  # a larger teacher is fine anyway
    swapped = ["model.vocab_size=152064", "teacher.model.vocab_size=151936"]
    with pytest.raises(ConfigError, match=r"teacher\.model\.vocab_size \(151936\)"):
        validate(load_config(None, swapped))
    validate(load_config(None, [*swapped, "data.vocab_size=151665"]))
    # data.vocab_size larger than the student's embedding is an error of its own
    msg = validation_error(None, "data.vocab_size=200")
    assert "data.vocab_size (200) exceeds model.vocab_size (128)" in msg


def test_fp8_needs_transformer_engine_layers() -> None:
    msg = validation_error(None, "model.fp8=e4m3")
    assert "model.fp8=e4m3 needs model.transformer_impl=transformer_engine" in msg
    msg = validation_error(None, "teacher.model.fp8=hybrid")
    assert "teacher.model.fp8=hybrid needs teacher.model.transformer_impl=transformer_engine" in msg
    validate(load_config(None, ["model.fp8=e4m3", "model.transformer_impl=transformer_engine"]))


def test_sequence_parallel_needs_tensor_parallel() -> None:
    msg = validation_error(None, "parallel.sequence_parallel=true")
    assert "parallel.sequence_parallel needs tensor_parallel > 1; set it to false" in msg
    validate(
        load_config(None, ["parallel.sequence_parallel=true", "parallel.tensor_parallel=2"]), 2
    )


def test_context_parallel_needs_transformer_engine() -> None:
    msg = validation_error(2, "parallel.context_parallel=2")
    assert "parallel.context_parallel > 1 needs model.transformer_impl=transformer_engine" in msg
    overrides = ["parallel.context_parallel=2", "model.transformer_impl=transformer_engine"]
    validate(load_config(None, overrides), 2)


def test_grpo_needs_several_samples_per_prompt() -> None:
    msg = validation_error(None, "algorithm.estimator=grpo", "rollout.samples_per_prompt=1")
    assert "rollout.samples_per_prompt must be >= 2" in msg
    # also when grpo is the outcome part of mix
    msg = validation_error(
        None,
        "algorithm.estimator=mix",
        "algorithm.outcome_weight=0.5",
        "rollout.samples_per_prompt=1",
    )
    assert "rollout.samples_per_prompt must be >= 2" in msg
    validate(load_config(None, ["algorithm.estimator=gndpo", "rollout.samples_per_prompt=1"]))


def test_mix_needs_a_positive_outcome_weight() -> None:
    msg = validation_error(None, "algorithm.estimator=mix")
    assert "algorithm.estimator=mix needs algorithm.outcome_weight > 0" in msg
    validate(load_config(None, ["algorithm.estimator=mix", "algorithm.outcome_weight=0.5"]))


def test_mix_parts_must_be_of_the_right_kind() -> None:
    msg = validation_error(
        None,
        "algorithm.estimator=mix",
        "algorithm.outcome_weight=1",
        "algorithm.distill_estimator=grpo",
        "algorithm.outcome_estimator=gndpo",
    )
    assert "algorithm.distill_estimator: unknown name 'grpo'" in msg
    assert "algorithm.outcome_estimator: unknown name 'gndpo'" in msg


def test_rollout_longer_than_the_models_positions() -> None:
    # default: 1024 + 2048 tokens against 4096 positions
    msg = validation_error(None, "rollout.max_response_length=4000")
    assert "rollout.max_prompt_length + rollout.max_response_length = 5024" in msg
    assert "exceeds model.max_position_embeddings (4096)" in msg
    assert "exceeds teacher.model.max_position_embeddings (4096)" in msg
    assert "shorten the rollout or raise max_position_embeddings" in msg
    validate(load_config(None, ["rollout.max_response_length=3072"]))  # exactly 4096 fits


def test_several_problems_are_listed_in_one_error() -> None:
    msg = validation_error(
        8,
        "teacher.parallel.tensor_parallel=3",
        "parallel.sequence_parallel=true",
        "algorithm.estimator=ppo",
        "algorithm.kl_clip=0",
        "teacher.model.vocab_size=64",
    )
    problems = [line for line in msg.splitlines() if line.startswith("  - ")]
    assert f"invalid configuration ({len(problems)} problem(s))" in msg
    for fragment in (
        "teacher.parallel: tensor_parallel (3)",
        "parallel.sequence_parallel needs tensor_parallel > 1",
        "algorithm.estimator: unknown name 'ppo'",
        "algorithm.kl_clip must be > 0",
        "teacher.model.vocab_size (64) is smaller",
    ):
        assert sum(fragment in p for p in problems) == 1, (fragment, problems)
    assert len(problems) >= 5


def test_validate_returns_the_config_unchanged() -> None:
    cfg = load_config(None, ["algorithm.kl_clip=3"])
    assert validate(cfg, 8) is cfg
    assert cfg == load_config(None, ["algorithm.kl_clip=3"])


# --------------------------------------------------------------------------------------------
# Environment


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None,
    reason="Transformer Engine installed",
)
@pytest.mark.parametrize("key", ["model.transformer_impl", "teacher.model.transformer_impl"])
def test_transformer_engine_missing_names_the_extra(key: str) -> None:
    cfg = load_config(None, [f"{key}=transformer_engine"])
    with pytest.raises(ConfigError) as err:
        check_environment(cfg)
    msg = str(err.value)
    assert "megatron-gndpo[te]" in msg  # the extra to install
    assert re.search(rf"{re.escape(key)}\s*[=:]\s*local", msg), msg  # or the key to change


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM installed")
def test_vllm_missing_names_the_extra() -> None:
    cfg = load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(ConfigError) as err:
        check_environment(cfg)
    msg = str(err.value)
    assert "megatron-gndpo[vllm]" in msg
    assert re.search(r"rollout\.engine\s*[=:]\s*builtin", msg), msg


def test_default_environment_needs_no_optional_package() -> None:
    check_environment(load_config())


# --------------------------------------------------------------------------------------------
# The resolved config


def test_save_resolved_round_trips(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "rollout.stop_token_ids=[3,4]",
            "optimizer.lr=3e-7",
            "algorithm.dual_clip=2.5",
            "algorithm.policy_loss=ppo_clip",
            "teacher.load=/ckpt/teacher",
            "logging.run_dir=x",
        ],
    )
    path = save_resolved(cfg, tmp_path / "run" / "nested")
    assert path == tmp_path / "run" / "nested" / "config.yaml"
    assert path.is_file()
    assert not list(path.parent.glob("*.tmp"))  # the temporary file was renamed away
    loaded = load_config(path)
    assert loaded == cfg
    assert loaded.rollout.stop_token_ids == (3, 4)
    # saving again overwrites in place
    cfg2 = load_config(None, ["trainer.steps=3"])
    assert load_config(save_resolved(cfg2, path.parent)) == cfg2


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_round_trips_through_yaml(example: Path, tmp_path: Path) -> None:
    cfg = load_config(example)
    assert build(Config, to_dict(cfg)) == cfg
    assert load_config(write(tmp_path, to_yaml(cfg))) == cfg


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_at_its_world_size(example: Path) -> None:
    world_size = example_world_size(example)
    cfg = load_config(example)
    validate(cfg, world_size)
    assert cfg != Config()  # the file was read


def test_examples_exist() -> None:
    assert len(EXAMPLES) >= 2, f"no examples found under {EXAMPLES_DIR}"


def test_missing_header_line_fails(tmp_path: Path) -> None:
    path = write(tmp_path, "# an example without its plan line\nmodel:\n  num_layers: 2\n")
    with pytest.raises(AssertionError, match="lacks the header line"):
        example_world_size(path)


def test_outlier_steps_and_gndpo_halves() -> None:
    """rollout.outlier_* (an outlier source for stability studies) and the GNDPO ablations."""
    validate(load_config(None, ["rollout.outlier_interval=10", "rollout.outlier_temperature=2"]))
    msg = validation_error(None, "rollout.outlier_interval=1")
    assert "makes every step an outlier step; set rollout.temperature or data.train" in msg
    msg = validation_error(None, "rollout.outlier_interval=10")
    assert "needs what makes those steps outliers: set rollout.outlier_temperature" in msg
    msg = validation_error(None, "data.outlier_train=builtin:chains")
    assert "data.outlier_train applies to outlier steps only: set rollout.outlier_interval" in msg
    validate(load_config(None, ["rollout.outlier_interval=4", "data.outlier_train=x.jsonl"]))
    msg = validation_error(None, "rollout.outlier_interval=-3")
    assert "rollout.outlier_interval must be >= 0, got -3" in msg
    msg = validation_error(None, "rollout.outlier_interval=5", "rollout.outlier_temperature=0")
    assert "rollout.outlier_temperature must be > 0" in msg
    validate(load_config(None, ["algorithm.gndpo_divide_std=false"]))
    msg = validation_error(None, "algorithm.estimator=opd", "algorithm.gndpo_subtract_mean=false")
    assert "algorithm.gndpo_subtract_mean=false applies to the gndpo estimator only" in msg
    msg = validation_error(
        None, "algorithm.gndpo_subtract_mean=false", "algorithm.gndpo_divide_std=false"
    )
    assert "is OPD: use algorithm.estimator=opd" in msg
