"""MoE routing between the sampler and the trainer (models/routing.py): the built-in sampler's
recorded experts, the mismatch metric and rollout routing replay, through megatron-core's
``RouterReplay``.

One 2-rank launch (student at EP=2, so replayed indices cross the dispatcher's all-to-all)
holds the model checks; the trainer path is in tests/test_moe.py's trainer launch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checks import validate
from megatron_gndpo.config import ConfigError, load_config
from megatron_gndpo.config.schema import ParallelConfig
from megatron_gndpo.models import routing
from megatron_gndpo.parallel.groups import ParallelLayout
from tests.harness import run_distributed
from tests.tiny import tiny_model

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny_cpu_moe.yaml"
VOCAB = 128
K = 2


def test_micro_batch_targets_place_rows_padded_and_packed() -> None:
    # 2 rows, 3 positions, 1 layer, top-2; row r position t routed to experts (t, t + 1 + r)
    given = torch.tensor(
        [[[[t, t + 1 + r]] for t in range(3)] for r in range(2)], dtype=torch.int16
    )
    padded = routing.micro_batch_targets(given, [(1, 0, 0), (0, 1, 0)], [2, 3], b=2, s=3)
    assert padded[0, :3, 0].tolist() == [[0, 2], [1, 3], [2, 4]]  # row 1 first
    assert padded[1, :2, 0].tolist() == [[0, 1], [1, 2]]
    assert padded[1, 2, 0].tolist() == [0, 1]  # padding: distinct experts 0..k-1
    packed = routing.micro_batch_targets(given, [(0, 0, 0), (1, 0, 2)], [2, 3], b=1, s=5)
    assert packed[0, :, 0].tolist() == [[0, 1], [1, 2], [0, 2], [1, 3], [2, 4]]


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        validate(load_config(EXAMPLE, list(overrides)), 2)
    return str(err.value)


def test_routing_replay_rules_name_the_fix() -> None:
    validate(load_config(EXAMPLE, ["algorithm.routing_replay=rollout"]), 2)
    msg = _problems("algorithm.routing_replay=rollout", "model.num_experts=null",
                    "parallel.expert_parallel=1")  # fmt: skip
    assert "needs a mixture-of-experts student (model.num_experts); set it to none" in msg
    msg = _problems("algorithm.routing_replay=rollout", "parallel.expert_parallel=1",
                    "parallel.tensor_parallel=2", "parallel.sequence_parallel=true")  # fmt: skip
    assert "with parallel.sequence_parallel or context_parallel > 1 is not supported" in msg
    with pytest.raises(ConfigError, match="routing_replay"):
        load_config(EXAMPLE, ["algorithm.routing_replay=always"])


def _scores(model: Any, groups: Any, rollout: Any, **kw: Any) -> torch.Tensor:
    from megatron_gndpo.engine.scoring import score_batch
    from megatron_gndpo.models.logprob_head import TokenLogProbs

    scores = score_batch(
        model, groups, rollout.tokens, rollout.lengths, head=TokenLogProbs(vocab_size=VOCAB),
        token_budget=kw.pop("token_budget", 4096), **kw,
    )  # fmt: skip
    assert scores is not None
    return scores.logprobs


def _routing_checks(rank: int, world: int) -> dict[str, Any]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.engine.update import Targets, UpdateBatch, _micro_batches
    from megatron_gndpo.models.gpt import build_gpt
    from megatron_gndpo.parallel.groups import build_student_groups
    from megatron_gndpo.rollout.base import SamplingParams
    from megatron_gndpo.rollout.builtin import MegatronGenerator

    groups = build_student_groups(ParallelLayout(world, ep=2), seed=1234)
    model = _moe_model()
    torch.manual_seed(0)
    net = build_gpt(model, ParallelConfig(expert_parallel=2), groups)
    generator = MegatronGenerator(
        net, groups, vocab_size=VOCAB, pad_id=0, max_sequence_length=96, record_routing=True
    )
    prompts = [[5, 6, 7, 8, 9], [10 + rank, 11, 12]]  # unequal: the lock-step's prompt decode
    params = SamplingParams(max_new_tokens=10, samples_per_prompt=2)
    rollout = generator.generate(prompts, params, seeds=[1 + rank, 2 + rank])
    out: dict[str, Any] = {"shape": list(rollout.routing.shape), "width": rollout.tokens.shape[1]}
    lengths = rollout.lengths.tolist()
    sampled = rollout.routing

    # the trainer's own choices (recorded), and the metric's count against the sampler's
    own = routing.RoutingPass(net, lengths)
    plain = _scores(net, groups, rollout, routing=own)
    compare = routing.RoutingPass(net, lengths, sampled)
    _scores(net, groups, rollout, routing=compare)
    chosen = own.routing
    differ = sum(
        int((chosen[r, : n - 1] != sampled[r, : n - 1]).any(-1).sum())
        for r, n in enumerate(lengths)
    )
    out["mismatch"] = (compare.mismatched, compare.compared, differ)
    out["distinct"] = bool((chosen.sort(-1).values.diff(dim=-1) > 0).all())

    # replaying the trainer's own choices changes nothing, padded or packed; changed experts at
    # row 0, position p are counted once a layer and change row 0's log-probs after p only
    replayed = _scores(
        net, groups, rollout, routing=routing.RoutingPass(net, lengths, chosen, replay=True)
    )
    packed = _scores(
        net,
        groups,
        rollout,
        pack=True,
        routing=routing.RoutingPass(net, lengths, chosen, replay=True),
    )
    out["replay_diff"] = (replayed - plain).abs().max().item()
    out["packed_diff"] = (packed - plain).abs().max().item()
    p = int(rollout.prompt_lengths[0]) + 1
    changed = chosen.clone()
    for layer in range(changed.shape[2]):  # other experts at row 0, position p, every layer
        old = set(changed[0, p, layer].tolist())
        other = [e for e in range(4) if e not in old][:K]
        changed[0, p, layer] = torch.tensor(other, dtype=torch.int16)
    counted = routing.RoutingPass(net, lengths, changed)
    _scores(net, groups, rollout, routing=counted)
    out["changed_counted"] = counted.mismatched
    forced = _scores(
        net, groups, rollout, routing=routing.RoutingPass(net, lengths, changed, replay=True)
    )
    delta = (forced - plain).abs()
    out["forced_before"] = delta[0, : p + 1].max().item()  # log-prob of token t+1 uses position t
    out["forced_after"] = delta[0, p + 1 :].max().item()
    out["forced_other_rows"] = delta[1:].max().item()
    out |= _hybrid_routing(net, model, groups, rollout, (plain, chosen), (forced, changed))

    # a row algorithm.filter dropped (a one-token stub, rollout/filters.py) is never compared,
    # and replaying the stubbed rollout leaves the kept rows' log-probs as they were
    from megatron_gndpo.rollout.filters import hollow

    keep = torch.tensor([True, False, True, True])
    stubbed = hollow(rollout, keep, pad_id=0)
    stub_lengths = stubbed.lengths.tolist()
    stub_count = routing.RoutingPass(net, stub_lengths, stubbed.routing)
    _scores(net, groups, stubbed, routing=stub_count)
    out["stub_compared"] = (
        stub_count.compared,
        compare.compared - (lengths[1] - 1) * sampled.shape[2],
    )
    replay = [
        _scores(net, groups, r, routing=routing.RoutingPass(net, n, r.routing, replay=True))
        for r, n in ((rollout, lengths), (stubbed, stub_lengths))
    ]
    out["stub_replay_diff"] = (replay[1][keep] - replay[0][keep]).abs().max().item()

    # the update's micro-batches carry the rows' routing at the model's positions (not shifted):
    # the training forward under replay gives the same logits as without, and changes with it
    mask = rollout.response_mask
    batch = UpdateBatch(
        rollout.tokens, plain, Targets(torch.zeros_like(plain)), mask, routing=chosen
    )
    [mb] = _micro_batches(batch, list(range(len(lengths))), len(lengths))
    positions = torch.arange(mb["tokens"].shape[1]).expand_as(mb["tokens"])
    net.train()
    free = net(mb["tokens"], positions, None).detach()
    batch_changed = UpdateBatch(
        rollout.tokens, plain, Targets(torch.zeros_like(plain)), mask, routing=changed
    )
    diffs = []
    for b in (batch, batch_changed):
        [m] = _micro_batches(b, list(range(len(lengths))), len(lengths))
        with routing.replaying(net) as replays:
            routing.set_targets(replays, m["routing"], "cpu")
            diffs.append((net(m["tokens"], positions, None).detach() - free).abs().max().item())
    out["update_replay_diff"], out["update_changed_diff"] = diffs
    return out


def _hybrid_routing(
    net: Any, model: Any, groups: Any, rollout: Any, own: tuple, forced: tuple
) -> dict[str, Any]:
    """The same weights as a HybridModel (``model_class: hybrid``): its routers, found in the
    same layer order, record the GPTModel's choices and replay forced ones to the same
    log-probs."""
    import dataclasses

    from megatron_gndpo.models import naming
    from megatron_gndpo.models.build import build_model

    hybrid_cfg = dataclasses.replace(model, model_class="hybrid")
    hybrid = build_model(hybrid_cfg, ParallelConfig(expert_parallel=2), groups)
    weights = dict(net.named_parameters())
    with torch.no_grad():
        for name, param in hybrid.named_parameters():
            param.copy_(weights[naming.to_gpt(name)])
    lengths = rollout.lengths.tolist()
    recorded = routing.RoutingPass(hybrid, lengths)
    plain = _scores(hybrid, groups, rollout, routing=recorded)
    replay = routing.RoutingPass(hybrid, lengths, forced[1], replay=True)
    return {
        "hybrid/same_routing": bool(torch.equal(recorded.routing, own[1])),
        "hybrid/plain_diff": (plain - own[0]).abs().max().item(),
        "hybrid/forced_diff": (_scores(hybrid, groups, rollout, routing=replay) - forced[0])
        .abs()
        .max()
        .item(),
    }


def _moe_model() -> Any:
    return tiny_model(
        hidden_size=64, ffn_hidden_size=128, vocab_size=VOCAB, num_experts=4,
        moe_ffn_hidden_size=64, moe_router_topk=K, max_position_embeddings=96,
    )  # fmt: skip


@pytest.mark.distributed
@pytest.mark.megatron
def test_sampler_routing_is_recorded_compared_and_replayed_at_ep2() -> None:
    for r in run_distributed(_routing_checks, 2, timeout_s=240):
        rows, width, layers, k = r["shape"]
        assert (rows, width, layers, k) == (4, r["width"], 2, K)
        assert r["distinct"], "every token's top-k experts are distinct"
        mismatched, compared, direct = r["mismatch"]
        assert mismatched == direct and compared > 0, r
        assert mismatched <= 0.02 * compared, r  # fp32 on CPU: the same choices almost always
        # (replayed experts come sorted, recorded ones in top-k order: the sums may reorder)
        assert r["replay_diff"] < 1e-5 and r["packed_diff"] < 1e-5, r
        assert r["changed_counted"] == layers, r
        assert r["hybrid/same_routing"], r
        assert r["hybrid/plain_diff"] < 1e-6 and r["hybrid/forced_diff"] < 1e-6, r
        assert r["forced_before"] < 1e-5 and r["forced_other_rows"] < 1e-5, r
        assert r["forced_after"] > 1e-4, r  # tiny random weights: small but far above 1e-5
        assert r["update_replay_diff"] < 1e-5, r
        assert r["update_changed_diff"] > 1e-4, r
        stub_compared, without_row = r["stub_compared"]
        assert stub_compared == without_row, r
        assert r["stub_replay_diff"] < 1e-5, r
