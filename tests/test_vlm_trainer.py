"""GNDPO with a vision-language student and teacher on CPU (gloo): DP=2, TP=2, PP=2 with the
teacher on another layout, and TrOPD with teacher-written prefixes; the frozen encoder never
changes, every trainable weight does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.trainers import reset_megatron, snapshot, tiny_trainer

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]

# A tiny VLM pair on the built-in visual task: 28 px digits, 16 image tokens per image;
# evaluation every step.
VLM = [
    "model.vision={}", "teacher.model.vision={}",
    "data.train=builtin:visual", "data.eval=builtin:visual_eval",
    "rollout.max_prompt_length=128", "model.max_position_embeddings=160",
    "teacher.model.max_position_embeddings=160", "trainer.steps=2", "trainer.eval_interval=1",
]  # fmt: skip
LAYOUTS = {
    "dp2": [],
    # with the rollout filter: 16 stop ids give short, finished and truncated responses; the
    # dropped rows cross to the teacher's layout as one-token stubs without images
    "tp2 / teacher pp2, filtered": [
        "parallel.tensor_parallel=2", "teacher.parallel.pipeline_parallel=2",
        f"rollout.stop_token_ids=[{','.join(str(i) for i in range(40, 56))}]",
        "algorithm.filter.drop_truncated=true", "algorithm.filter.min_response_tokens=2",
    ],
    "pp2 / teacher tp2": ["parallel.pipeline_parallel=2", "teacher.parallel.tensor_parallel=2"],
    # TrOPD with teacher-written prefixes: the VLM teacher answers with the images (on its own
    # layout), the student continues half of it at step 1, a quarter at step 2
    # vOPD over the full vocabulary (the teacher's hidden states meet the student's output
    # layer) equals top-k vOPD with k = every id the policy can sample (the character
    # tokenizer's 100 less the image placeholder)
    "full vopd / tp2": [
        "algorithm.estimator=vopd", "algorithm.vopd_top_k=0", "parallel.tensor_parallel=2",
        "teacher.parallel.tensor_parallel=2",
    ],
    "all-ids vopd / tp2": [
        "algorithm.estimator=vopd", "algorithm.vopd_top_k=99", "parallel.tensor_parallel=2",
        "teacher.parallel.tensor_parallel=2",
    ],
    "tropd prefixes / teacher pp2": [
        "algorithm.estimator=tropd", "algorithm.tropd.top_k=4",
        "algorithm.tropd.prefix_share_start=0.5", "algorithm.tropd.prefix_decay_steps=2",
        "teacher.parallel.pipeline_parallel=2",
    ],
}  # fmt: skip


def _vlm_runs(rank: int, world: int, root: str) -> list[dict[str, object]]:
    out = []
    for name, overrides in LAYOUTS.items():
        trainer = tiny_trainer(f"{root}/{len(out)}", *VLM, *overrides)
        student = snapshot(trainer.c.student)
        teacher = snapshot(trainer.c.teacher.model)
        frozen = {n for n, p in trainer.c.student.named_parameters() if not p.requires_grad}
        history = trainer.train()  # two steps, an evaluation each, a final checkpoint
        params = dict(trainer.c.student.named_parameters())
        moved = {n for n, p in params.items() if not torch.equal(p, student[n])}
        teacher_moved = [
            n for n, p in trainer.c.teacher.model.named_parameters()
            if not torch.equal(p, teacher[n])
        ]  # fmt: skip
        out.append({
            "name": name, "history": history, "frozen": sorted(frozen),
            "frozen_moved": sorted(moved & frozen),
            "trainable_still": sorted(set(student) - frozen - moved),
            "teacher_moved": teacher_moved,
        })  # fmt: skip
        trainer.c.logger.close()
        reset_megatron()
    # Resume: the PP=2 run's checkpoint reloads into a new trainer at its step.
    pp2 = list(LAYOUTS).index("pp2 / teacher tp2")
    trainer = tiny_trainer(f"{root}/{pp2}", *VLM, *LAYOUTS["pp2 / teacher tp2"])
    described = sorted(p.name for p in trainer.c.save_dir.glob("*.yaml"))
    out.append({"name": "resumed", "step": trainer.step_count, "described": described})
    reset_megatron()
    return out


def test_vlm_gndpo_trains_at_dp2_tp2_pp2(tmp_path: Path) -> None:
    results = run_distributed(_vlm_runs, 2, args=(str(tmp_path),), timeout_s=600)
    for per_rank in results:
        *runs, resumed = per_rank
        assert resumed["step"] == 2
        assert resumed["described"] == ["model_config.yaml", "vision_config.yaml"]
        for r in runs:
            name = r["name"]
            assert r["frozen_moved"] == [], f"{name}: frozen weights changed {r['frozen_moved']}"
            assert r["trainable_still"] == [], f"{name}: not updated {r['trainable_still']}"
            assert r["teacher_moved"] == [], f"{name}: teacher changed"
            for m in r["history"]:
                assert m["skipped"] == 0.0 and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
                assert math.isfinite(m["loss"]) and m["tokens/step"] > 0, name
                assert 0.0 <= m["eval/accuracy"] <= 1.0, name
            if name.endswith("filtered"):  # rows dropped, teacher work saved, tokens exact
                dropped = [m["filter/rows_dropped_frac"] for m in r["history"]]
                assert all(0 < d < 1 for d in dropped), dropped
                assert all(m["filter/tokens_kept"] == m["tokens/global"] for m in r["history"])
                assert all(m["filter/teacher_tokens_saved"] > 0 for m in r["history"])
            if name.startswith("tropd"):
                first, second = r["history"]
                assert (first["tropd/prefix_share"], second["tropd/prefix_share"]) == (0.5, 0.25)
                assert 0 < second["tropd/teacher_written_frac"] < 1
                assert second["tropd/teacher_written_frac"] < first["tropd/teacher_written_frac"]
        full, every = (next(r for r in runs if r["name"] == n) for n in
                       ("full vopd / tp2", "all-ids vopd / tp2"))  # fmt: skip
        for got, ref in zip(full["history"], every["history"], strict=True):
            for key in ("loss", "grad_norm", "vopd/kl_mean"):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
        # the encoder is frozen on the first stage (where it lives) of every layout
        assert any(r["frozen"] for r in runs)
