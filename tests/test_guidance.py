"""TGPO / TrOPD / forward-KL pieces against float64 references, and the update's token loss."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from megatron_gndpo.algorithms import guidance
from megatron_gndpo.config.schema import AlgorithmConfig


def _batch(seed: int, b: int = 3, t: int = 7, k: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = 11
    student_full = torch.randn(b, t, vocab, generator=g, dtype=torch.float64).log_softmax(-1)
    teacher_full = torch.randn(b, t, vocab, generator=g, dtype=torch.float64).log_softmax(-1)
    ids = torch.randint(0, vocab, (b, t, k), generator=g)
    sampled = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    return {
        "student_full": student_full,
        "teacher_full": teacher_full,
        "ids": ids,
        "ls": student_full.gather(-1, sampled.unsqueeze(-1)).squeeze(-1),
        "lt": teacher_full.gather(-1, sampled.unsqueeze(-1)).squeeze(-1),
        "mask": mask,
    }


def test_schedules() -> None:
    # λ_k = max(λ_0 − (k − 1)·δ, 0) with the release defaults
    assert guidance.linear_decay(1, 0.002, 1e-5) == 0.002
    assert guidance.linear_decay(101, 0.002, 1e-5) == pytest.approx(0.001)
    assert guidance.linear_decay(1000, 0.002, 1e-5) == 0.0
    assert guidance.linear_schedule(1, 0.5, 0.0, 10) == 0.5
    assert guidance.linear_schedule(6, 0.5, 0.0, 10) == pytest.approx(0.25)
    assert guidance.linear_schedule(50, 0.5, 0.0, 10) == 0.0
    assert guidance.linear_schedule(3, 0.5, 0.1, 0) == 0.1
    with pytest.raises(ValueError, match="counted from 1"):
        guidance.linear_decay(0, 0.002, 1e-5)


@pytest.mark.parametrize("seed", [0, 1])
def test_forward_kl_to_targets_matches_reference(seed: int) -> None:
    b = _batch(seed)
    target = b["teacher_full"].gather(-1, b["ids"])  # teacher top-k-like, unnormalised
    student = b["student_full"].gather(-1, b["ids"]).float().requires_grad_()
    got = guidance.forward_kl_to_targets(student, target.float())
    want = (target.exp() * (target - student.detach().double())).sum(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert student.grad is not None
    torch.testing.assert_close(student.grad.double(), -target.exp(), rtol=1e-5, atol=1e-6)
    # One guidance token with q = 1 is the cross-entropy −ls; q = 0 entries contribute nothing.
    one = guidance.forward_kl_to_targets(student[..., :1], torch.zeros_like(student[..., :1]))
    torch.testing.assert_close(one, -student[..., 0].detach())
    none = torch.full_like(student, -math.inf)
    assert torch.equal(guidance.forward_kl_to_targets(student, none), torch.zeros(3, 7))


def test_tropd_routing_per_outlier_rule() -> None:
    b = _batch(3)
    lt, lo, mask = b["lt"].float(), b["ls"].float(), b["mask"]
    trusted = (lt >= lo) & mask
    outliers = ~(lt >= lo) & mask
    score = (lt - lo).clamp(-5.0, 5.0)
    adv, pg, kl = guidance.tropd_routing(lt, lo, mask, kl_clip=5.0, outlier="topk_kl")
    assert torch.equal(adv, torch.where(trusted, score, 0.0))
    assert torch.equal(pg, trusted.float()) and torch.equal(kl, outliers.float())
    adv, pg, kl = guidance.tropd_routing(lt, lo, mask, kl_clip=5.0, outlier="mask")
    assert torch.equal(pg, trusted.float()) and not kl.any()
    adv, pg, kl = guidance.tropd_routing(
        lt, lo, mask, kl_clip=5.0, outlier="clip", outlier_clip=0.5
    )
    want = torch.where(trusted, score, torch.where(outliers, score.clamp(min=-0.5), 0.0))
    assert torch.equal(adv, want) and torch.equal(pg, mask.float()) and not kl.any()
    # A looser threshold trusts more tokens: π_T ≥ 0.5·π_S
    loose = guidance.trusted_tokens(lt, lo, 0.5)
    assert torch.equal(loose, lt - lo >= math.log(0.5))
    with pytest.raises(ValueError, match="outlier rule"):
        guidance.tropd_routing(lt, lo, mask, kl_clip=5.0, outlier="drop")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        guidance.trusted_tokens(lt, lo, 1.5)


def test_guidance_advantage_bonus() -> None:
    b = _batch(4)
    outcome = torch.randn(3, 7)
    got = guidance.guidance_advantages(outcome, b["ls"].float(), b["mask"], 0.1)
    want = torch.where(b["mask"], outcome + 0.1 * b["ls"].float().exp(), 0.0)
    torch.testing.assert_close(got, want)


def test_token_loss_routes_each_term() -> None:
    """The update's per-token loss g·PG + λ·d·FKL − β·H, against a hand computation."""
    from megatron_gndpo.engine.update import Targets, UpdateBatch, policy_loss, token_loss
    from megatron_gndpo.models.logprob_head import Scores

    b = _batch(5)
    lp = b["ls"].float()
    extra = b["student_full"].gather(-1, b["ids"]).float()
    logq = b["teacher_full"].gather(-1, b["ids"]).float()
    entropy = -(b["student_full"].exp() * b["student_full"]).sum(-1).float()
    g = torch.Generator().manual_seed(9)
    mb = {
        "old": lp + 0.1 * torch.randn(3, 7, generator=g),
        "adv": torch.randn(3, 7, generator=g),
        "mask": b["mask"],
        "pg_mask": (torch.rand(3, 7, generator=g) > 0.5).float(),
        "aux_ids": b["ids"],
        "aux_logq": logq,
        "aux_mask": (torch.rand(3, 7, generator=g) > 0.5).float(),
    }
    cfg = AlgorithmConfig(policy_loss="ppo_clip")
    batch = UpdateBatch(
        torch.zeros(3, 7, dtype=torch.long), mb["old"],
        Targets(mb["adv"], aux_coef=0.3, entropy_coef=0.01), b["mask"],
    )  # fmt: skip
    output = Scores(lp, extra_logprobs=extra, entropy=entropy)
    loss, info = token_loss(output, mb, batch, cfg)
    pg, _ = policy_loss(lp, mb["old"], mb["adv"], b["mask"], cfg)
    fkl = (logq.exp() * (logq - extra)).sum(-1)
    want = mb["pg_mask"] * pg + 0.3 * mb["aux_mask"] * fkl - 0.01 * entropy
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(info["aux"], fkl)
    # A plain batch: the policy loss alone, from a bare log-prob tensor.
    plain = UpdateBatch(
        torch.zeros(3, 7, dtype=torch.long), mb["old"], Targets(mb["adv"]), b["mask"]
    )
    assert plain.plain
    loss, _ = token_loss(lp, {k: mb[k] for k in ("old", "adv", "mask")}, plain, cfg)
    torch.testing.assert_close(loss, pg)


def test_config_rules_for_guidance_methods() -> None:
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import load_config
    from megatron_gndpo.config.loader import ConfigError
    from megatron_gndpo.config.schema import Config
    from megatron_gndpo.methods import build_method

    def beta(**algorithm: Any) -> float:
        return build_method(AlgorithmConfig(**algorithm)).entropy_coef

    assert beta(estimator="tgpo") == 0.001  # the method's default
    assert (beta(estimator="gndpo"), beta(estimator="mix")) == (0.0, 0.0)
    assert beta(estimator="tgpo", entropy_coef=0.0) == 0.0
    cfg = load_config(
        None,
        [
            "algorithm.estimator=tgpo", "algorithm.tgpo.guidance=advantage",
            "algorithm.tgpo.teacher_token=topk", "algorithm.tropd.trust_threshold=0",
            "algorithm.tropd.prefix_share_start=1.0", "rollout.samples_per_prompt=1",
        ],
    )  # fmt: skip
    assert isinstance(cfg, Config)
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    text = str(err.value)
    for needle in ("guidance=loss", "trust_threshold", "prefix_share_start", "samples_per_prompt"):
        assert needle in text


def test_rollout_continued_from_teacher_prefixes() -> None:
    from megatron_gndpo.rollout.base import Rollout, with_teacher_prefix

    # prompt 0 = [5, 6], its teacher prefix [7]; prompt 1 = [5], prefix [8, 9]; one sample each
    tokens = torch.tensor([[5, 6, 7, 1, 2, 3, 0], [5, 8, 9, 4, 4, 4, 4]])
    continued = Rollout(
        tokens=tokens, prompt_lengths=torch.tensor([3, 3]), lengths=torch.tensor([6, 7]),
        sampler_logprobs=torch.where(tokens > 0, -0.5, 0.0), prompt_index=torch.tensor([0, 1]),
        finished=torch.tensor([True, False]),
    )  # fmt: skip
    r = with_teacher_prefix(continued, [1, 2], max_response_length=4)
    assert r.prompt_lengths.tolist() == [2, 1]
    assert r.lengths.tolist() == [6, 5]  # row 1 cut to 1 + 4 tokens
    assert r.finished.tolist() == [True, False]
    assert r.teacher_written is not None
    assert r.teacher_written.tolist() == [
        [False, False, True, False, False, False],
        [False, True, True, False, False, False],
    ]
    assert r.response_mask.sum(-1).tolist() == [4, 4]
    assert r.tokens[1].tolist() == [5, 8, 9, 4, 4, 0]
    assert r.sampler_logprobs[1, 5] == 0.0


def test_head_samples_teacher_tokens_like_the_vocab_parallel_sampler() -> None:
    """TGPO's sampled teacher token: the head's draw is vocab_parallel_sample's, per seed."""
    import types

    from megatron_gndpo.models.logprob_head import ScoreContext, Scores, TokenLogProbs
    from megatron_gndpo.parallel.vocab_stats import vocab_parallel_sample

    g = torch.Generator().manual_seed(0)
    s, b, h, v = 6, 2, 8, 32
    hidden, weight = torch.randn(s, b, h, generator=g), torch.randn(v, h, generator=g)
    layer = types.SimpleNamespace(
        weight=weight, tp_group=types.SimpleNamespace(size=lambda: 1), sequence_parallel=False
    )
    head = TokenLogProbs(vocab_size=30, temperature=0.7)

    def draw(seed: int) -> torch.Tensor:
        context = ScoreContext(torch.zeros(b, s, dtype=torch.long), sample_seed=seed)
        out = head(hidden_states=hidden, output_layer=layer, output_weight=None,
                   context=context, config=None)  # fmt: skip
        assert isinstance(out, Scores) and out.sampled_ids is not None
        return out.sampled_ids

    want = vocab_parallel_sample(
        hidden.reshape(s * b, h), weight, generator=torch.Generator().manual_seed(5),
        vocab_size=30, temperature=0.7,
    ).view(s, b).transpose(0, 1)  # fmt: skip
    assert torch.equal(draw(5), want)
    assert int(draw(5).max()) < 30  # padding ids are never drawn
    assert not torch.equal(draw(5), draw(6))


def test_teacher_prefixes_need_whole_prompts_per_teacher_replica() -> None:
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import load_config
    from megatron_gndpo.config.loader import ConfigError

    cfg = load_config(
        None,
        ["algorithm.estimator=tropd", "algorithm.tropd.prefix_share_start=0.5",
         "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2"],
    )  # fmt: skip
    validate(cfg, 4)  # teacher DP 4 answers 4 prompts: one each
    with pytest.raises(ConfigError, match="teacher-written prefixes"):
        validate(cfg, 8)  # 8 rows divide by teacher DP 8, the 4 prompts do not
