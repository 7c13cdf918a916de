"""``megatron-gndpo prune``: a student made from a teacher checkpoint, and how layers are chosen.

One single-rank launch builds a random tiny teacher (4 layers), saves it, prunes it through the
command line in depth and width, loads the students and compares them with the teacher run
without the same layers and neurons; a second teacher with one layer made an identity shows
that both importances find it. The argument checks run in-process, before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.prune.student import pruned_state, student_config, top_neurons
from tests.harness import run_distributed
from tests.tiny import tiny_model

pytestmark = [pytest.mark.megatron]

_VOCAB = 100  # the built-in character tokenizer's ids
_TEACHER = dict(num_layers=4, ffn_hidden_size=48, vocab_size=_VOCAB)


def test_pruned_state_renumbers_layers_and_cuts_both_swiglu_halves() -> None:
    teacher = {
        "embedding.word_embeddings.weight": torch.randn(8, 4),
        **{
            f"decoder.layers.{i}.mlp.linear_fc1.weight": torch.full((6, 4), float(i))
            for i in range(3)
        },
        **{
            f"decoder.layers.{i}.mlp.linear_fc2.weight": torch.arange(12.0).reshape(4, 3) + i
            for i in range(3)
        },
    }
    teacher["decoder.layers.2.mlp.linear_fc1.weight"] = torch.arange(24.0).reshape(6, 4)
    keep_F = torch.tensor([0, 2])
    out = pruned_state(teacher, [0, 2], neurons=[keep_F, keep_F], swiglu=True)
    assert sorted(out) == sorted(
        ["embedding.word_embeddings.weight"]
        + [f"decoder.layers.{j}.mlp.linear_fc{k}.weight" for j in (0, 1) for k in (1, 2)]
    )
    fc1 = out["decoder.layers.1.mlp.linear_fc1.weight"]  # teacher layer 2: gate rows 0-2, up 3-5
    assert torch.equal(fc1, torch.arange(24.0).reshape(6, 4)[[0, 2, 3, 5]])
    assert torch.equal(out["decoder.layers.1.mlp.linear_fc2.weight"], teacher[
        "decoder.layers.2.mlp.linear_fc2.weight"][:, [0, 2]])  # fmt: skip
    assert out["embedding.word_embeddings.weight"] is teacher["embedding.word_embeddings.weight"]
    assert torch.equal(top_neurons(torch.tensor([0.1, 3.0, 0.2, 2.0]), 2), torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="cannot keep 5 of 4 FFN neurons"):
        top_neurons(torch.ones(4), 5)
    moe = tiny_model(num_experts=4, vocab_size=_VOCAB)
    with pytest.raises(ValueError, match="prunes in depth only"):
        student_config(moe, num_layers=1, ffn_hidden_size=8)


def _logits(net: Any, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return net(tokens, positions, attention_mask=None)[..., :_VOCAB].float()


def _teacher(root: Path, groups: Any, identity_layer: int | None = None) -> Any:
    """A random tiny teacher saved at ``root``; ``identity_layer``'s residual branches zeroed
    (its output is its input)."""
    from megatron_gndpo.checkpoint.convert import describe_checkpoints
    from megatron_gndpo.checkpoint.dist import save_checkpoint
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.models.gpt import build_gpt

    model = tiny_model(**_TEACHER)
    torch.manual_seed(0)
    net = build_gpt(model, ParallelConfig(), groups)
    with torch.no_grad():
        for p in net.parameters():  # larger than the init, so every layer matters
            p.add_(torch.randn_like(p) * 0.1)
        if identity_layer is not None:
            layer = net.decoder.layers[identity_layer]
            layer.self_attention.linear_proj.weight.zero_()
            layer.mlp.linear_fc2.weight.zero_()
    save_checkpoint(root, 0, net, model_config=model)
    describe_checkpoints(root, model)
    return net.eval()


def _prune_body(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from megatron.core import parallel_state

    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.cli import main
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups
    from megatron_gndpo.prune.importance import only_layers

    cpu.enable_if_no_cuda()
    root = Path(tmp)
    groups = build_student_groups(ParallelLayout(1), seed=0)
    teacher = _teacher(root / "teacher", groups)
    common = ["--tokenizer", "builtin:char", "--calib-data", "builtin:arithmetic",
              "--calib-samples", "6", "--calib-new-tokens", "6"]  # fmt: skip
    assert main(["prune", "--teacher", str(root / "teacher"), "--out", str(root / "depth"),
                 "--keep-layers", "0,2", *common]) == 0  # fmt: skip
    assert main(["prune", "--teacher", str(root / "teacher"), "--out", str(root / "width"),
                 "--num-layers", "3", "--ffn-hidden-size", "20", *common]) == 0  # fmt: skip
    tokens = torch.randint(0, _VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}

    depth_model = tiny_model(**_TEACHER | {"num_layers": 2})
    depth = build_gpt(depth_model, ParallelConfig(), groups).eval()
    load_checkpoint(root / "depth", depth)
    with only_layers(teacher, [0, 2]):
        out["depth_diff"] = float((_logits(depth, tokens) - _logits(teacher, tokens)).abs().max())

    report = json.loads((root / "width" / "prune.json").read_text())
    keep = report["keep_layers"]
    width = build_gpt(tiny_model(**_TEACHER | {"num_layers": 3, "ffn_hidden_size": 20}),
                      ParallelConfig(), groups).eval()  # fmt: skip
    load_checkpoint(root / "width", width)
    # the teacher with the cut neurons silenced (their fc2 columns zero) is the student
    with torch.no_grad():
        for j, i in enumerate(keep):
            fc1 = width.decoder.layers[j].mlp.linear_fc1.weight  # [2F', H]
            teacher_fc1 = teacher.decoder.layers[i].mlp.linear_fc1.weight  # [2F, H]
            gate = teacher_fc1.chunk(2)[0]
            kept = [int((gate == row).all(1).nonzero()) for row in fc1.chunk(2)[0]]
            dropped = sorted(set(range(gate.shape[0])) - set(kept))
            teacher.decoder.layers[i].mlp.linear_fc2.weight[:, dropped] = 0.0
    with only_layers(teacher, keep):
        out["width_diff"] = float((_logits(width, tokens) - _logits(teacher, tokens)).abs().max())
    out["width_report"] = report
    out["depth_report"] = json.loads((root / "depth" / "prune.json").read_text())
    out["model_config"] = (root / "width" / "model_config.yaml").read_text()
    parallel_state.destroy_model_parallel()

    # a layer that does nothing is the first to go, by either measure
    groups = build_student_groups(ParallelLayout(1), seed=0)
    _teacher(root / "identity", groups, identity_layer=2)
    for importance in ("kl", "cosine"):
        assert main(["prune", "--teacher", str(root / "identity"), "--out",
                     str(root / f"id_{importance}"), "--num-layers", "3",
                     "--importance", importance, *common]) == 0  # fmt: skip
        out[importance] = json.loads((root / f"id_{importance}" / "prune.json").read_text())
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def pruned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("prune")
    return tmp, run_distributed(_prune_body, 1, (str(tmp),), timeout_s=300)[0]


def test_depth_pruned_student_is_the_teacher_without_those_layers(
    pruned: tuple[Path, dict[str, Any]],
) -> None:
    _, out = pruned
    assert out["depth_diff"] < 1e-5, out["depth_diff"]
    report = out["depth_report"]
    assert report["keep_layers"] == [0, 2] and report["scores"] == {"given": True}
    assert report["num_layers"] == 2 and report["kl"] > 0.0
    assert report["student_parameters"] < report["teacher_parameters"]
    assert report["calibration_sequences"] == 6 and report["calibration_tokens"] > 6


def test_width_pruned_student_keeps_the_most_active_neurons(
    pruned: tuple[Path, dict[str, Any]],
) -> None:
    _, out = pruned
    assert out["width_diff"] < 1e-5, out["width_diff"]
    report = out["width_report"]
    assert report["ffn_hidden_size"] == 20 and len(report["keep_layers"]) == 3
    rounds = report["scores"]["rounds"]  # greedy: one round, the layer that cost least went
    assert len(rounds) == 1 and set(rounds[0]) == {"0", "1", "2", "3"}
    dropped = min(rounds[0], key=rounds[0].__getitem__)
    assert dropped not in map(str, report["keep_layers"])
    assert "num_layers: 3" in out["model_config"] and "ffn_hidden_size: 20" in out["model_config"]


def test_a_layer_that_does_nothing_is_dropped_first(pruned: tuple[Path, dict[str, Any]]) -> None:
    _, out = pruned
    assert out["kl"]["keep_layers"] == [0, 1, 3]
    assert out["kl"]["kl"] < 1e-9 and out["kl"]["scores"]["rounds"][0]["2"] < 1e-9
    assert out["cosine"]["keep_layers"] == [0, 1, 3]
    bi = out["cosine"]["scores"]["block_importance"]
    assert bi[2] < 1e-6 < min(bi[0], bi[1], bi[3])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--keep-layers", "2,0"], "name distinct teacher layers in increasing order"),
        (["--keep-layers", "0,1,2,3"], "keeps all 4 layers: leave at least one out"),
        (["--num-layers", "4"], "keep 1 to 3 (or cut the FFN with --ffn-hidden-size)"),
        (["--num-layers", "2", "--ffn-hidden-size", "49"], "FFN is 48 wide; choose 1 to 48"),
    ],
)
def test_impossible_requests_name_the_fix(
    pruned: tuple[Path, dict[str, Any]],
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from megatron_gndpo.cli import main

    tmp, _ = pruned
    out = tmp / "refused"
    code = main(["prune", "--teacher", str(tmp / "teacher"), "--out", str(out), *args,
                 "--tokenizer", "builtin:char", "--calib-data", "builtin:arithmetic"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()  # refused before anything was written


def test_output_and_inputs_are_checked_before_loading(
    pruned: tuple[Path, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_gndpo.cli import main

    tmp, _ = pruned
    teacher = str(tmp / "teacher")
    base = ["prune", "--teacher", teacher, "--num-layers", "2", "--tokenizer", "builtin:char"]
    mine = tmp / "user_files"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main([*base, "--out", str(mine), "--calib-data", "builtin:arithmetic"]) == 2
    assert "is not empty (it holds notes.txt); name a new directory" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "keep me"
    with pytest.raises(SystemExit) as exc:  # argparse: --calib-data is required
        main([*base, "--out", str(tmp / "new")])
    assert exc.value.code == 2
    assert "the following arguments are required: --calib-data" in capsys.readouterr().err
    no_tok = ["prune", "--teacher", teacher, "--num-layers", "2", "--out", str(tmp / "n2"),
              "--calib-data", "builtin:arithmetic"]  # fmt: skip
    assert main(no_tok) == 2
    assert "no tokenizer files beside" in capsys.readouterr().err


def _saved_step(root: Path, step: int, *, has_optimizer: bool) -> Path:
    """A step directory as resolve() and training_steps() see it (its metadata only)."""
    directory = root / f"iter_{step:07d}"
    directory.mkdir(parents=True)
    meta = {"step": step, "run_id": "r", "has_optimizer": has_optimizer}
    (directory / "megatron_gndpo.json").write_text(json.dumps(meta))
    (root / "latest").write_text(f"{step}\n")
    return directory


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_the_student_never_replaces_the_teacher_a_run_or_other_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 48, probes 1-2: ``--out`` the teacher itself (``--overwrite`` deleted its steps and
    tokenizer) or a run's checkpoints; and ``--overwrite`` on files prune did not write."""
    from megatron_gndpo.cli import main

    teacher = tmp_path / "teacher"
    step = _saved_step(teacher, 0, has_optimizer=True)
    (teacher / "tokenizer.model").write_bytes(b"sentencepiece")
    run = tmp_path / "run"
    _saved_step(run / "checkpoints", 330, has_optimizer=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    before = _files(tmp_path)
    common = ["--keep-layers", "0,1,3", "--tokenizer", "builtin:char", "--calib-data",
              "builtin:arithmetic", "--overwrite"]  # fmt: skip
    for source, out, message in [
        (teacher, teacher, "is the teacher checkpoint"),
        (step, teacher, "is the teacher checkpoint"),
        (teacher, step, "lies inside the teacher checkpoint"),
        (teacher, teacher / "student", "lies inside the teacher checkpoint"),
        (teacher, tmp_path, "holds the teacher checkpoint"),
        (teacher, run / "checkpoints", "holds a training run's checkpoints (newest iter_0000330)"),
        (teacher, run, "holds a training run's checkpoints in checkpoints/ (newest"),
        (teacher, mine, "holds notes.txt, not a student prune wrote (no prune.json)"),
    ]:
        code = main(["prune", "--teacher", str(source), "--out", str(out), *common])
        err = capsys.readouterr().err
        assert code == 2 and message in err, (out, err)
        assert err.count("\n") == 1 and "name a new directory" in err, err
    assert _files(tmp_path) == before  # nothing written, nothing deleted


def test_a_request_is_checked_before_loading_and_errors_name_prunes_own_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 48, probe 15: a bad --num-layers was refused only after ~40 s of loading; prune's
    hints named train's settings (data.prompt_key, checkpoint.start_fresh); --calib-data was
    shown as optional."""
    from megatron_gndpo.checkpoint.convert import describe_checkpoints
    from megatron_gndpo.cli import main

    teacher = tmp_path / "teacher"
    _saved_step(teacher, 0, has_optimizer=False)
    describe_checkpoints(teacher, tiny_model(**_TEACHER))  # its architecture; no weights
    base = ["prune", "--teacher", str(teacher), "--out", str(tmp_path / "student")]
    calib = ["--calib-data", "builtin:arithmetic"]

    def error(*args: str) -> str:
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        return err

    # before the tokenizer (which does not exist here) or anything else is loaded
    err = error("--num-layers", "9", "--tokenizer", str(tmp_path / "none.model"), *calib)
    assert "--num-layers 9: the teacher has 4 layers; keep 1 to 3" in err
    err = error("--num-layers", "2", "--tokenizer", str(tmp_path / "none.model"), *calib)
    assert "none.model does not exist; set --tokenizer to an existing .model file" in err
    err = error("--keep-layers", "0,7", "--tokenizer", str(tmp_path / "none.model"), *calib)
    assert "--keep-layers 0,7: name distinct teacher layers in increasing order, each 0 to 3" in err
    prompts = tmp_path / "calib.jsonl"
    prompts.write_text('{"question": "1 + 1 = ?"}\n')
    err = error("--num-layers", "2", "--tokenizer", "builtin:char", "--calib-data", str(prompts))
    assert "no 'prompt' field; the record has ['question']. Set --calib-prompt-key to" in err
    err = error("--num-layers", "2", "--tokenizer", "builtin:char", "--calib-data", "x.jsonl")
    assert "fix --calib-data, or use builtin:arithmetic" in err and "data.train" not in err
    (teacher / "latest").write_text("zero\n")
    err = error("--num-layers", "2", "--tokenizer", "builtin:char", *calib)
    assert "is corrupt (holds 'zero'" in err and "checkpoint.start_fresh" not in err
    assert "or name a complete iter_* step directory instead of its root" in err
    with pytest.raises(SystemExit):
        main(["prune", "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert "--calib-data CALIB_DATA" in usage and "[--calib-data" not in usage
