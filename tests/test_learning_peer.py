"""The learning peer (benchmarks/learning_peer.py), short: TRL's on-policy distillation and our
OPD from the same exported student, measured by the same evaluation.

One single-rank launch: a tiny teacher fine-tuned briefly and its pruned student (the demo's own
preparation), exported to Hugging Face; our trainer and TRL's ``DistillationTrainer`` each take
3 steps. What must hold: both evaluators see the same start (the same greedy answers, the same
reverse KL up to the draws of their samples), both sides move the student, the comparison table
is written. The learning claim itself is the benchmark's (docs/demo/RESULTS.md): 3 seeds x 100
steps do not fit CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_distributed

pytest.importorskip("trl", reason="trl is not installed (the peer extra: pip install -e '.[peer]')")
pytestmark = [pytest.mark.megatron]


def _short_peer(rank: int, world: int, root: str) -> dict[str, Any]:
    import dataclasses

    from megatron.core import parallel_state

    from benchmarks import learning_peer as peer
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.demo import models
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    cpu.enable_if_no_cuda()
    out, cache = Path(root) / "peer", Path(root) / "cache"
    task = models.build_task(cache)
    groups = build_student_groups(ParallelLayout(1), seed=0)
    recipe = dataclasses.replace(models.teacher_recipe(quick=True), name="tiny_teacher", steps=40)
    teacher = models.prepare(cache, recipe, groups, task)
    student = models.prepare_pruned(cache, teacher, task, groups)
    vocab = task.tokenizer.vocab_size
    teacher_dir = peer.export_hf(teacher, out / "hf" / "teacher", vocab)
    student_dir = peer.export_hf(student, out / "hf" / "student", vocab)
    parallel_state.destroy_model_parallel()
    s = peer.PeerSettings(steps=3, seeds=(7,), eval_interval=3, prompts_per_step=8)
    length = models.max_new_tokens(task.difficulty)
    ours = peer.run_ours(cache, out, teacher, student, task, s, quick=True)
    trl = peer.run_trl(teacher_dir, student_dir, task, s, out, length)
    rows = peer.compare([*ours, *trl], len(task.eval))
    return {"ours": ours, "trl": trl, "table": peer.markdown(rows, s, {"ours": 1.0})}


def test_trl_and_ours_measure_the_same_start_and_both_train(tmp_path: Path) -> None:
    out = run_distributed(_short_peer, 1, (str(tmp_path),), timeout_s=600)[0]
    (ours,), (trl,) = out["ours"], out["trl"]
    assert [c["step"] for c in ours["curve"]] == [0, 3] == [c["step"] for c in trl["curve"]]
    start_ours, start_trl = ours["curve"][0], trl["curve"][0]
    # the same exported student decoded greedily by megatron and by transformers
    assert start_ours["eval/accuracy"] == start_trl["eval/accuracy"]
    # each side's own 512 samples: the same reverse KL up to the draws
    kl_ours, kl_trl = start_ours["eval/reverse_kl"], start_trl["eval/reverse_kl"]
    assert kl_ours > 0.05 and abs(kl_ours - kl_trl) < 0.15 * kl_ours, (kl_ours, kl_trl)
    assert abs(start_ours["eval/sampled_accuracy"] - start_trl["eval/sampled_accuracy"]) < 0.1
    for run in (ours, trl):  # three steps moved the student (its reverse KL changed)
        assert run["curve"][1]["eval/reverse_kl"] != run["curve"][0]["eval/reverse_kl"], run
    assert "| 0 | " in out["table"] and "| 3 | " in out["table"]
