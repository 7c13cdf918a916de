"""benchmarks/ending_signal.py: a signal's push on the stop token is minus its loss's gradient."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ending_signal as es

STOP = 2


def case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(3, 5, 30, generator=g).log_softmax(-1)
    logits = torch.randn(3, 5, 30, generator=g, requires_grad=True)
    tokens = torch.randint(0, 30, (3, 5), generator=g)
    tokens[0, 2] = tokens[2, 4] = STOP
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    return teacher, logits, tokens, mask


def stop_push(loss: torch.Tensor, logits: torch.Tensor) -> float:
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    return float(-grad[..., STOP].sum())


def test_pushes_are_minus_the_gradients_on_the_stop_logit() -> None:
    lt, z, tokens, mask = case()
    ls = z.log_softmax(-1)
    found = es.pushes(lt, ls.detach(), tokens, mask, STOP, clip=5.0, top_k=4)
    m = mask.float()

    reverse = ((ls.exp() * (ls - lt)).sum(-1) * m).sum()
    assert found["reverse_kl_exact"] == pytest.approx(stop_push(reverse, z), rel=1e-5)

    top_p, top_ids = lt.exp().topk(4, dim=-1)
    forward = ((top_p * (top_p.log() - ls.gather(-1, top_ids))).sum(-1) * m).sum()
    assert found["forward_kl_topk"] == pytest.approx(stop_push(forward, z), rel=1e-5)

    picked = ls.gather(-1, tokens[..., None])[..., 0]
    score = lt.gather(-1, tokens[..., None])[..., 0] - picked.detach()
    advantage = (score - score[mask].mean()).clamp(-5, 5)
    policy = -(advantage * picked * m).sum()
    assert found["sampled_score"] == pytest.approx(stop_push(policy, z), rel=1e-5)
    parts = found["sampled_score_from_stop_tokens"] + found["sampled_score_from_other_tokens"]
    assert parts == pytest.approx(found["sampled_score"], rel=1e-5)

    split = found["reverse_kl_exact_where_teacher_ends"] + found["reverse_kl_exact_elsewhere"]
    assert split == pytest.approx(found["reverse_kl_exact"], rel=1e-5)
    to_go = (score * m).flip(-1).cumsum(-1).flip(-1)
    policy = -((to_go - to_go[mask].mean()) * picked * m).sum()
    assert found["sampled_score_to_go"] == pytest.approx(stop_push(policy, z), rel=1e-5)
    # seq-mean weights: every answer alike, the same total weight as the token mean
    lengths = m.sum(-1, keepdim=True)
    weights = m / lengths * (m.sum() / 3)
    reverse = ((ls.exp() * (ls - lt)).sum(-1) * weights).sum()
    assert found["reverse_kl_exact_seq_mean"] == pytest.approx(stop_push(reverse, z), rel=1e-5)


def test_ending_measures_find_where_the_teacher_would_end() -> None:
    lt, z, tokens, mask = case(1)
    lt = lt.clone()
    lt[0, 1] = torch.full((30,), -20.0)
    lt[0, 1, STOP] = 0.0  # the teacher ends at row 0, position 1
    found = es.ending_measures(lt, z.detach().log_softmax(-1), tokens, mask, STOP)
    assert found["positions"] == 13
    assert found["sampled_stops"] == 2
    assert found["answers_teacher_would_end"] == pytest.approx(1 / 3)
    p_s = z.detach().softmax(-1)[0, 1, STOP]
    assert found["p_student_stop_where_teacher_would_end"] == pytest.approx(float(p_s))
