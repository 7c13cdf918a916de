"""The algorithms on several gloo ranks equal the single-process result on the whole batch.

One launch per world size runs every check (a launch costs seconds of imports). The batch is
split unevenly: rank 0 holds rows without a response token and, from three ranks on, rank 1
holds no rows at all; both must still take part in every collective. Shapes: [B, T].
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_gndpo import algorithms as alg
from tests.harness import run_distributed

ROWS, LENGTH, SEED = 11, 7, 1234
EMPTY_ROWS = 3  # rows 0..2 have no response token
MICRO_BATCH_ROWS = 2
LOSSES = ("ppo_clip", "gspo")

# Rows per rank: rank 0 gets the token-less rows; from 3 ranks on, rank 1 gets none.
SPLITS = {1: [11], 2: [3, 8], 3: [3, 0, 8], 4: [3, 0, 5, 3]}


def make_batch() -> dict[str, torch.Tensor]:
    """The same ragged, right-padded batch on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(SEED)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=gen)
    lengths[:EMPTY_ROWS] = 0
    lengths[-1] = LENGTH
    old = -3.0 * torch.rand(ROWS, LENGTH, generator=gen)
    return {
        "mask": (torch.arange(LENGTH) < lengths.unsqueeze(1)).float(),
        "old": old,
        "teacher": old + 4.0 * torch.randn(ROWS, LENGTH, generator=gen),
        "logprobs": old + 0.5 * torch.randn(ROWS, LENGTH, generator=gen),
        "token_rewards": torch.randn(ROWS, LENGTH, generator=gen),
    }


def shard(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    counts = SPLITS[world_size]
    start = sum(counts[:rank])
    return {k: v[start : start + counts[rank]] for k, v in batch.items()}


def policy_loss(name: str, b: dict[str, torch.Tensor], lp: torch.Tensor, adv: torch.Tensor):
    if name == "ppo_clip":
        return alg.ppo_clip_loss(lp, b["old"], adv, dual_clip=3.0)
    return alg.gspo_token_loss(lp, b["old"], adv, b["mask"])


def step(b: dict[str, torch.Tensor], group, micro_rows: int) -> dict[str, object]:
    """Advantages, metrics and per-token-loss gradients of one shard, Megatron style."""
    adv = alg.gndpo_advantages(b["teacher"], b["old"], b["mask"], kl_clip=5.0, group=group)
    _, info = policy_loss("ppo_clip", b, b["logprobs"], adv)
    out: dict[str, object] = {
        "gndpo": adv,
        "reinforce_pp": alg.reinforce_pp_advantages(
            b["token_rewards"], b["mask"], gamma=0.9, group=group
        ),
        "metrics": {
            **alg.score_metrics(b["teacher"], b["old"], b["mask"], kl_clip=5.0, group=group),
            **alg.advantage_metrics(adv, b["mask"], group=group),
            **alg.policy_metrics(info, b["mask"], group=group),
        },
    }
    for name in LOSSES:
        for mode in alg.AGGREGATIONS:
            lp = b["logprobs"].clone().requires_grad_(True)
            numerator, count = torch.zeros(()), torch.zeros((), dtype=torch.int32)
            for i in range(0, lp.shape[0], micro_rows):  # backward per micro-batch
                rows = slice(i, i + micro_rows)
                micro = {k: v[rows] for k, v in b.items()}
                loss_bt, _ = policy_loss(name, micro, lp[rows], adv[rows])
                num, cnt = alg.aggregate_loss(loss_bt, micro["mask"], mode)
                num.backward()
                numerator, count = numerator + num.detach(), count + cnt
            total = alg.global_count(count, group)  # what megatron-core reduces over DP x CP
            grad = lp.grad if lp.grad is not None else torch.zeros_like(lp)
            out[f"grad/{name}/{mode}"] = grad / total
            out[f"loss/{name}/{mode}"] = (alg.global_sum(numerator, group) / total).item()
    return out


def _ranks_body(rank: int, world_size: int) -> dict[str, object]:
    group = dist.group.WORLD
    out = step(shard(make_batch(), rank, world_size), group, MICRO_BATCH_ROWS)
    # Fewer than two valid tokens in the whole batch: every rank must raise, none may hang.
    for n_tokens in (0, 1):
        mask = torch.zeros(ROWS, LENGTH)
        mask[-1, :n_tokens] = 1.0
        tiny = shard({"mask": mask, "scores": torch.randn(ROWS, LENGTH)}, rank, world_size)
        try:
            alg.gndpo_advantages(
                tiny["scores"], torch.zeros_like(tiny["scores"]), tiny["mask"], group=group
            )
            out[f"raised/{n_tokens}"] = ""
        except ValueError as err:
            out[f"raised/{n_tokens}"] = str(err)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", sorted(SPLITS))
def test_sharded_algorithms_equal_single_process(world_size):
    per_rank = run_distributed(_ranks_body, world_size, timeout_s=120)
    reference = step(make_batch(), None, ROWS)  # one process, one micro-batch

    for key in ("gndpo", "reinforce_pp", *(k for k in reference if k.startswith("grad/"))):
        gathered = torch.cat([r[key] for r in per_rank])
        torch.testing.assert_close(gathered, reference[key], atol=1e-6, rtol=1e-6, msg=key)
    for r in per_rank:
        assert r["metrics"].keys() == reference["metrics"].keys()
        for name, value in reference["metrics"].items():
            assert r["metrics"][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
        for key in (k for k in reference if k.startswith("loss/")):
            assert r[key] == pytest.approx(reference[key], rel=1e-6, abs=1e-9), key
        for n_tokens in (0, 1):
            assert f"(got {n_tokens})" in r[f"raised/{n_tokens}"]
    assert reference["metrics"]["tokens/global"] == make_batch()["mask"].sum().item()
