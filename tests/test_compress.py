"""``megatron-gndpo compress``: the whole recipe on tiny models built in code.

One single-rank launch writes a random tiny Hugging Face teacher (4 layers, the built-in
character tokenizer's 100 ids), compresses it end to end (convert, prune to 2 layers, one
warm-up step, two distillation steps, evaluations at every step, the report), runs the same
command again (every stage skipped), and compresses the converted megatron teacher as it is
(``--keep-layers``, no warm-up). The refusals run in-process, before anything is loaded.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from megatron_gndpo.compress.answers import first_sentence, task_score, words
from tests.harness import run_distributed

pytestmark = [pytest.mark.megatron]

_QUESTIONS = [
    {"prompt": "1 + 2 = ?", "reference": "3", "task": "sum"},
    {"prompt": "Say: a cat.", "reference": "a cat", "task": "repeat"},
    {"prompt": "2 + 2 = ?", "reference": "4", "task": "sum"},
]
_TRAIN = [{"prompt": f"{a} + {b} = ?"} for a in range(3) for b in range(3)]
# The tiny trainer: 2 prompts x 2 samples a step, answers of at most 6 characters.
_OVERRIDES = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
              "rollout.max_prompt_length=32", "rollout.max_response_length=6",
              "trainer.micro_batch_size=4", "optimizer.lr=1e-3"]  # fmt: skip


def test_the_task_score_reads_the_first_sentence_only() -> None:
    assert words("The capital: PARIS!") == ["the", "capital", "paris"]
    assert first_sentence("\n  Paris. Not Rome") == "  Paris"
    assert first_sentence("") == ""
    assert task_score("capital", "Paris. It is big.", "Paris") == 1.0
    assert task_score("capital", "It is big. Paris.", "Paris") == 0.0  # a later sentence
    assert task_score("capital", "Parisian food", "Paris") == 0.0  # a whole word only
    assert task_score("capital", "It is New York, I think", "new york") == 1.0  # a phrase
    assert task_score("repeat", "A cat, sat!", "a cat sat") == 1.0
    assert task_score("repeat", "a cat sat. a cat sat.", "a cat sat") == 0.0  # the sentence only


def _hf_teacher(path: Path) -> None:
    """A random Llama-shaped Hugging Face model of 4 layers over the character tokenizer's ids,
    every weight perturbed so each layer matters."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)


def _write_jsonl(path: Path, records: list[dict[str, str]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _args(tmp: Path, teacher: Path, out: Path, *extra: str) -> list[str]:
    return ["compress", "--teacher", str(teacher), "--out", str(out), "--tokenizer",
            "builtin:char", "--eval", str(tmp / "eval.jsonl"), "--calib-samples", "4",
            "--eval-samples", "1", *extra, *_OVERRIDES,
            f"data.train={tmp / 'train.jsonl'}"]  # fmt: skip


def _main(argv: list[str]) -> tuple[int, str]:
    from megatron_gndpo.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def _compress_body(rank: int, world: int, tmp_dir: str) -> dict[str, Any]:
    tmp = Path(tmp_dir)
    _hf_teacher(tmp / "hf")
    run = tmp / "run"
    first = _args(tmp, tmp / "hf", run, "--layers", "2", "--warmup-steps", "1", "--steps", "2",
                  "--eval-interval", "1")  # fmt: skip
    found: dict[str, Any] = {"first": _main(first)}
    found["again"] = _main(first)
    found["mcore"] = _main(_args(tmp, run / "teacher", tmp / "as_is", "--keep-layers", "0,3",
                                 "--steps", "1", "--eval-interval", "5"))  # fmt: skip
    return found


@pytest.fixture(scope="module")
def compressed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("compress")
    _write_jsonl(tmp / "eval.jsonl", _QUESTIONS)
    _write_jsonl(tmp / "train.jsonl", _TRAIN)
    return tmp, run_distributed(_compress_body, 1, (str(tmp),), timeout_s=300)[0]


def test_the_rows_a_short_sft_run_reads_are_known_before_it() -> None:
    from megatron_gndpo.data.sampler import PromptSampler
    from megatron_gndpo.sft import drawn_rows

    rows = drawn_rows(9, steps=2, batch_size=4, seed=3)
    sampler = PromptSampler(9, prompts_per_step=4, dp_rank=0, dp_size=1, seed=3)
    assert rows == sorted({i for _ in range(2) for i in sampler.next_step()}) and len(rows) == 8
    assert drawn_rows(9, steps=3, batch_size=4, seed=3) == list(range(9))  # past an epoch: all


def test_every_stage_writes_its_output_and_the_report_has_the_measures(
    compressed: tuple[Path, dict[str, Any]],
) -> None:
    tmp, found = compressed
    code, said = found["first"]
    run = tmp / "run"
    assert code == 0, said
    assert "report written to" in said and "skipped" not in said
    assert (run / "teacher" / "model_config.yaml").is_file()  # converted
    prune = json.loads((run / "pruned" / "prune.json").read_text())
    assert prune["num_layers"] == 2 and prune["importance"] == "cosine"
    assert (run / "warmup" / "model_config.yaml").is_file()
    # one warm-up step of 4 sequences: the teacher answered those 4 of the 9 prompts only
    assert json.loads((run / "stages" / "warmup.json").read_text())["sequences"] == 4
    assert (run / "distill" / "checkpoints" / "latest").read_text().strip() == "2"
    assert sorted(p.stem for p in (run / "stages").iterdir()) == [
        "baseline",
        "distill",
        "prune",
        "teacher",
        "warmup",
    ]
    lines = [json.loads(x) for x in (run / "curves.jsonl").read_text().splitlines()]
    assert [(x["stage"], x["step"]) for x in lines] == [
        ("teacher", None),
        ("pruned", 0),
        ("warmup", 1),
        ("distill", 2),
        ("distill", 3),
    ]
    teacher = lines[0]
    assert teacher["agreement"] == 1.0 and abs(teacher["reverse_kl"]) < 1e-4  # itself
    for x in lines:
        assert 0 <= x["task"] <= 1 and 0 <= x["greedy_eos"] <= 1 and x["greedy_length"] > 0
    assert lines[1]["reverse_kl"] > 0.0  # the pruned student is not the teacher
    report = (run / "report.md").read_text()
    for header in ("reverse KL", "agreement", "task", "greedy EOS", "sampled len"):
        assert header in report
    assert "| teacher | - |" in report and "| distill | 3 |" in report
    assert "## Wall time" in report and "- distill:" in report
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rerun_skips_every_finished_stage(compressed: tuple[Path, dict[str, Any]]) -> None:
    _, found = compressed
    code, said = found["again"]
    assert code == 0, said
    for stage in ("teacher", "prune", "baseline", "warmup", "distill"):
        assert f"[compress] {stage}: complete in" in said and "skipped" in said, stage
    assert "running" not in said


def test_a_megatron_teacher_is_used_as_it_is(compressed: tuple[Path, dict[str, Any]]) -> None:
    tmp, found = compressed
    code, said = found["mcore"]
    assert code == 0, said
    out = tmp / "as_is"
    assert not (out / "teacher").exists() and not (out / "warmup").exists()
    assert json.loads((out / "pruned" / "prune.json").read_text())["keep_layers"] == [0, 3]
    steps = [json.loads(x)["step"] for x in (out / "curves.jsonl").read_text().splitlines()]
    assert steps == [None, 0, 1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "4"], "--layers 4: the teacher has 4 layers; the student keeps 1 to 3"),
        (["--keep-layers", "0,9"], "name distinct teacher layers in increasing order, each 0 to 3"),
        (
            ["--layers", "2", "--eval", "missing.jsonl"],
            "missing.jsonl: no such file; name a .jsonl",
        ),
        (
            ["--layers", "2", "trainer.steps=3"],
            "override trainer.steps: compress sets it from --steps",
        ),
        (["--layers", "2", "--steps", "0"], "--steps 0: must be at least 1"),
        (["--layers", "2", "algorithm.estimatr=opd"], "did you mean algorithm.estimator?"),
    ],
)
def test_bad_inputs_are_one_line_naming_the_fix(
    compressed: tuple[Path, dict[str, Any]], args: list[str], message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from megatron_gndpo.cli import main

    tmp, _ = compressed
    out = tmp / "refused"
    argv = _args(tmp, tmp / "run" / "teacher", out)
    if "--eval" in args:  # the later --eval wins
        argv += ["--eval", str(tmp / args[args.index("--eval") + 1])]
        args = [a for a in args if a not in ("--eval", "missing.jsonl")]
    code = main([*argv, *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()  # refused before anything was written


def test_an_out_of_other_settings_or_files_is_refused(
    compressed: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_gndpo.cli import main

    tmp, _ = compressed
    teacher = tmp / "run" / "teacher"
    assert main(_args(tmp, teacher, tmp / "run", "--keep-layers", "0,3")) == 2
    err = capsys.readouterr().err
    assert "holds a compress run made with other settings" in err and "keep_layers" in err, err
    mine = tmp / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(_args(tmp, teacher, mine, "--layers", "2")) == 2
    assert "is not empty and holds no compress.json" in capsys.readouterr().err
    assert main(_args(tmp, tmp / "nowhere", tmp / "new", "--layers", "2")) == 2
    assert "--teacher" in capsys.readouterr().err and not (tmp / "new").exists()
