"""The VLM: encoders, projectors, frozen parts, and response log-probs in the combined sequence.

Two 2-rank launches (TP=2, then PP=2). In each, the fused log-prob scoring of rows with images
equals a reference that runs the model on each full row, gathers the logits and picks every
token's log-prob by hand (a response that starts right after an image included); one optimizer
step through megatron's schedule leaves the frozen encoder bitwise unchanged, changes every
trainable parameter, and the optimizer holds no frozen parameter. At TP=2 (no pipeline) the
combined sequence also equals megatron-core's own ``LLaVAModel.forward`` on compact ids.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from megatron_gndpo.config.schema import OptimizerConfig, ParallelConfig
from megatron_gndpo.config.vision import VisionConfig
from tests.harness import run_distributed
from tests.tiny import tiny_model

VOCAB = 60
IMAGE = 3  # the placeholder id
MODEL = tiny_model(
    vocab_size=VOCAB,
    make_vocab_size_divisible_by=32,
    max_position_embeddings=128,
    add_qkv_bias=True,
)
ENCODERS = {
    "clip": VisionConfig(image_size=28, patch_size=7, image_token_id=IMAGE),
    "siglip": VisionConfig(encoder="siglip", drop_class_token=False, image_token_id=IMAGE),
    "internvit": VisionConfig(
        encoder="internvit",
        pixel_shuffle=True,
        layer_scale=0.1,
        projector="norm_mlp",
        image_token_id=IMAGE,
    ),
}


def test_tokens_per_tile_and_config_checks() -> None:
    assert ENCODERS["clip"].tokens_per_tile == 16  # (28 / 7)^2, class token dropped
    assert ENCODERS["siglip"].tokens_per_tile == 16
    assert ENCODERS["internvit"].tokens_per_tile == 4  # pixel shuffle folds 2x2 patches
    assert ENCODERS["internvit"].encoder_output_size == 4 * 32
    assert VisionConfig(drop_class_token=False).tokens_per_tile == 17
    with pytest.raises(ValueError, match="must divide image_size") as err:
        VisionConfig(image_size=30, patch_size=7, encoder="siglip")
    assert "drop_class_token=false" in str(err.value)  # every problem is listed
    with pytest.raises(ValueError, match="even patch grid"):
        VisionConfig(image_size=21, patch_size=7, pixel_shuffle=True)


def test_layer_scale_add_matches_internvit_residual() -> None:
    from megatron_gndpo.models.vision import LayerScaleAdd

    scale = LayerScaleAdd(4, 0.1, torch.float32)
    x, bias, residual = torch.randn(3, 2, 4), torch.randn(4), torch.randn(3, 2, 4)
    out = scale(False)((x, bias), residual, 0.0)
    torch.testing.assert_close(out, residual + 0.1 * (x + bias))


# -------------------------------------------------------------------------------------------
# Rows: [text, image, text, response]; a response right after an image; two images (one at
# position 0); text only. Lengths differ so micro-batches are padded.


def _rows(tokens_per_tile: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
    g = torch.Generator().manual_seed(5)
    text = lambda n: [int(t) for t in torch.randint(4, VOCAB, (n,), generator=g)]
    img = [IMAGE] * tokens_per_tile
    rows = [
        text(3) + img + text(6),
        text(2) + img + text(4),  # the response starts right after the image
        img + text(2) + img + text(3),
        text(7),
    ]
    n_images = [1, 1, 2, 0]
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    images = [torch.randn(n, 3, 28, 28, generator=g) if n else None for n in n_images]
    return tokens, lengths, images


def _reference_logprobs(model, groups, tokens, lengths, images):  # type: ignore[no-untyped-def]
    """Each row alone through the pipeline, full (gathered) logits, log-probs picked by hand."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_gndpo.parallel.groups import schedule_groups

    rows = []
    for r, n in enumerate(lengths.tolist()):
        ids = tokens[r : r + 1, :n]
        rows.append((images[r], ids, torch.arange(n).unsqueeze(0)))

    def forward_step(data_iterator, net):  # type: ignore[no-untyped-def]
        image, ids, positions = next(data_iterator)
        logits = net(image, ids, positions, None, runtime_gather_output=True)
        return logits, lambda output, non_loss_data=True: output.detach()

    with torch.no_grad():
        outputs = get_forward_backward_func(pp_size=groups.layout.pp)(
            forward_step_func=forward_step,
            data_iterator=iter(rows),
            model=[model],
            num_microbatches=len(rows),
            seq_length=int(lengths.max()),
            micro_batch_size=1,
            forward_only=True,
            collect_non_loss_data=True,
            **schedule_groups(groups, model.config),
        )
    if not groups.is_last_stage:
        return None
    expected = torch.zeros(tokens.shape, dtype=torch.float64)
    for r, logits in enumerate(outputs):
        logp = logits[0, :, :VOCAB].double().log_softmax(-1)  # [n, V]
        for t in range(1, int(lengths[r])):
            if tokens[r, t] != IMAGE:
                expected[r, t] = logp[t - 1, tokens[r, t]]
    return expected


def _compact(tokens_row: torch.Tensor, tokens_per_tile: int) -> torch.Tensor:
    """LLaVA's own convention: one placeholder per image."""
    out, t = [], 0
    while t < len(tokens_row):
        out.append(int(tokens_row[t]))
        t += tokens_per_tile if tokens_row[t] == IMAGE else 1
    return torch.tensor(out)


def _upstream_equal(model, tokens, lengths, images, vision) -> float:  # type: ignore[no-untyped-def]
    """Max |ours - LLaVAModel.forward| over each row's logits (pipeline size 1 only)."""
    from megatron.core.models.multimodal.llava_model import LLaVAModel

    worst = 0.0
    with torch.no_grad():
        for r, n in enumerate(lengths.tolist()):
            ids = tokens[r : r + 1, :n]
            ours = model(images[r], ids, None, None, runtime_gather_output=True)
            compact = _compact(ids[0], vision.tokens_per_tile).unsqueeze(0)
            # LLaVAModel.forward reads images.dtype even without images: pass zero tiles
            tiles = images[r] if images[r] is not None else torch.zeros(0, 3, 28, 28)
            theirs, _ = LLaVAModel.forward(
                model, tiles, compact, None, None, runtime_gather_output=True
            )
            worst = max(worst, float((ours - theirs).abs().max()))
    return worst


def _micro_batch(tokens_BS, lengths, images, rows) -> types.SimpleNamespace:  # type: ignore[no-untyped-def]
    """``rows`` right-padded (pad id 0, not the placeholder) with next-token targets and their
    tiles concatenated in row order."""
    width = max(lengths[r] for r in rows)
    tokens = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : lengths[r]] = tokens_BS[r, : lengths[r]]
    targets = torch.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    positions = torch.arange(width).unsqueeze(0).expand(len(rows), -1)
    tiles = [images[r] for r in rows if images[r] is not None]
    return types.SimpleNamespace(
        tokens=tokens, positions=positions, targets=targets,
        images=torch.cat(tiles) if tiles else None,
    )  # fmt: skip


def _train_step(model, groups, tokens, lengths, images) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """One optimizer step on the response log-likelihood: what changed, what it optimises."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_gndpo.engine.optimizer import build_optimizer, step_optimizer, wrap_ddp
    from megatron_gndpo.models.logprob_head import TokenLogProbs

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    ddp = wrap_ddp(model, use_distributed_optimizer=True)
    optimizer = build_optimizer(ddp, OptimizerConfig(lr=1e-2, use_distributed_optimizer=True))
    head = TokenLogProbs(vocab_size=VOCAB)
    lengths_list = lengths.tolist()
    micro = [_micro_batch(tokens, lengths_list, images, rows) for rows in ([0, 1], [2, 3])]

    def forward_step(data_iterator, net):  # type: ignore[no-untyped-def]
        mb = next(data_iterator)
        logprobs = net(
            mb.images, mb.tokens, mb.positions, None,
            output_processor=head, output_processor_context=mb.targets,
        )  # fmt: skip
        mask = (mb.targets != IMAGE) & (mb.targets != 0)

        def loss_func(logprobs_bL):  # type: ignore[no-untyped-def]
            loss = -(logprobs_bL * mask).sum()
            return loss, mask.sum(), {"loss": loss.detach().clone()}

        return logprobs, loss_func

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro),
        model=[ddp],
        num_microbatches=len(micro),
        seq_length=int(lengths.max()),
        micro_batch_size=2,
        forward_only=False,
    )
    metrics = step_optimizer(optimizer, None)
    in_buffers = {id(p) for buffer in ddp.buffers for p in buffer.params}
    named = dict(model.named_parameters())
    return {
        "skipped": metrics["skipped"],
        "frozen": sorted(frozen),
        "frozen_changed": [n for n in frozen if not torch.equal(named[n], before[n])],
        "trainable_unchanged": [
            n for n, p in named.items() if n not in frozen and torch.equal(p, before[n])
        ],
        "frozen_in_optimizer": [n for n in frozen if id(named[n]) in in_buffers],
        "trainable_missing": [
            n for n in named if n not in frozen and id(named[n]) not in in_buffers
        ],
    }


def _vlm_checks(rank: int, world: int, tp: int, pp: int) -> dict[str, object]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.engine.scoring import score_multimodal
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.models.vlm import build_vlm
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    groups = build_student_groups(ParallelLayout(world, tp=tp, pp=pp), seed=7)
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp)
    head = TokenLogProbs(vocab_size=VOCAB, chunk_tokens=5)
    results: dict[str, object] = {"last": groups.is_last_stage, "first": groups.is_first_stage}
    for name, vision in ENCODERS.items():
        if pp > 1 and name == "siglip":
            continue  # the pipeline does not depend on the encoder type: save launch time
        torch.manual_seed(0)
        model = build_vlm(MODEL, vision, parallel, groups)
        tokens, lengths, images = _rows(vision.tokens_per_tile)
        got = score_multimodal(
            model, groups, tokens, lengths, images, head=head, token_budget=2 * 30
        )
        expected = _reference_logprobs(model, groups, tokens, lengths, images)
        results[name] = (got, expected, tokens, lengths)
        if pp == 1:
            results[f"{name}/upstream"] = _upstream_equal(model, tokens, lengths, images, vision)
    # the last model (InternViT: frozen encoder, trainable norm-MLP projector) trains one step
    results["train"] = _train_step(model, groups, tokens, lengths, images)
    return results


def _check(results: list[dict[str, object]], pp: int) -> None:
    for rank, result in enumerate(results):
        for name in ENCODERS:
            if name not in result:
                continue
            if result["last"]:
                got, expected, tokens, lengths = result[name]  # type: ignore[misc]
                assert got.dtype == torch.float32
                torch.testing.assert_close(
                    got.double(), expected, rtol=1e-5, atol=2e-5, msg=f"rank {rank} {name}"
                )
                # the response token right after row 1's image has a real log-prob
                after_image = int((tokens[1] == IMAGE).nonzero().max()) + 1
                assert got[1, after_image] < 0
                assert torch.all(got[tokens == IMAGE] == 0) and torch.all(got[:, 0] == 0)
                for row, n in enumerate(lengths.tolist()):
                    assert torch.all(got[row, n:] == 0)
            if pp == 1:
                assert result[f"{name}/upstream"] < 1e-5, (name, result[f"{name}/upstream"])
        train = result["train"]
        assert train["skipped"] == 0.0
        if result["first"]:
            assert any(n.startswith("vision_model.") for n in train["frozen"])
            assert all(n.startswith("vision_model.") for n in train["frozen"])
        assert train["frozen_changed"] == [], f"rank {rank}: frozen weights moved"
        assert train["trainable_unchanged"] == [], f"rank {rank}: {train['trainable_unchanged']}"
        assert train["frozen_in_optimizer"] == [] and train["trainable_missing"] == []


@pytest.mark.distributed
@pytest.mark.megatron
def test_vlm_tp2_logprobs_upstream_and_frozen_encoder() -> None:
    _check(run_distributed(_vlm_checks, 2, args=(2, 1), timeout_s=300), pp=1)


@pytest.mark.distributed
@pytest.mark.megatron
def test_vlm_pp2_logprobs_and_frozen_encoder() -> None:
    _check(run_distributed(_vlm_checks, 2, args=(1, 2), timeout_s=300), pp=2)


def test_vision_configs_are_frozen_dataclasses() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ENCODERS["clip"].image_size = 56  # type: ignore[misc]


# -------------------------------------------------------------------------------------------
# Rollouts with images: KV-cached generation equals a full recompute of each sampled row.


def _generate_with_images(rank: int, world: int) -> dict[str, object]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    from megatron_gndpo.models.vlm import build_vlm
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups
    from megatron_gndpo.rollout.base import SamplingParams
    from megatron_gndpo.rollout.multimodal import MultimodalGenerator

    groups = build_student_groups(ParallelLayout(world), seed=3)
    vision = ENCODERS["internvit"]
    torch.manual_seed(0)
    model = build_vlm(MODEL, vision, ParallelConfig(), groups)
    n = vision.tokens_per_tile
    g = torch.Generator().manual_seed(1)
    # megatron's lock-step path: the prefill (the shortest prompt: 4 positions) holds half of
    # the first image; the rest of it, and all of the second, are fed one placeholder a forward
    prompts = [
        [5, 6] + [IMAGE] * n + [7],
        [8, 9, 10, 11, 12, 13, 14] + [IMAGE] * n + [15],
        [16] * 4,
    ]
    images = [torch.randn(1, 3, 28, 28, generator=g), torch.randn(1, 3, 28, 28, generator=g), None]
    params = SamplingParams(max_new_tokens=6, samples_per_prompt=2)
    rollouts = {
        decoder: MultimodalGenerator(
            model, groups, vocab_size=VOCAB, pad_id=0,
            max_sequence_length=MODEL.max_position_embeddings, decoder=decoder,
        ).generate(prompts, params, seeds=[1, 2, 3], images=images)
        for decoder in ("lean", "megatron")
    }  # fmt: skip
    rollout = rollouts["lean"]
    expected = torch.zeros(rollout.tokens.shape, dtype=torch.float64)
    with torch.no_grad():
        model.eval()
        for row in range(rollout.tokens.shape[0]):
            length = int(rollout.lengths[row])
            ids = rollout.tokens[row : row + 1, :length]
            logits = model(images[row // 2], ids, None, None, runtime_gather_output=True)
            logits = logits[0].double()
            logits[:, VOCAB:] = float("-inf")
            logits[:, IMAGE] = float("-inf")  # the generator never samples the placeholder
            logp = logits.log_softmax(-1)
            for t in range(int(rollout.prompt_lengths[row]), length):
                expected[row, t] = logp[t - 1, ids[0, t]]
    # The trainer's scoring of the same rows: with the placeholder excluded (as the trainer's
    # heads do for a VLM) it is the sampler's distribution; over the whole vocabulary it is not
    from megatron_gndpo.engine.scoring import score_multimodal
    from megatron_gndpo.models.logprob_head import TokenLogProbs

    row_images = [images[int(i)] for i in rollout.prompt_index]
    scored = {}
    for name, excluded in (("excluded", (IMAGE,)), ("whole vocabulary", ())):
        head = TokenLogProbs(VOCAB, excluded_ids=excluded)
        scored[name] = score_multimodal(
            model, groups, rollout.tokens, rollout.lengths, row_images, head=head, token_budget=256
        )
    return {
        "rollout": rollout,
        "expected": expected,
        "scored": scored,
        "static": rollouts["megatron"],
    }


@pytest.mark.distributed
@pytest.mark.megatron
def test_generation_with_images_matches_full_recompute() -> None:
    result = run_distributed(_generate_with_images, 1, timeout_s=200)[0]
    rollout, expected = result["rollout"], result["expected"]
    # the lean decoder (whole prompts prefilled) and megatron's lock-step path (the shortest
    # prompt's prefill holds half of the first image) sample the same rows
    static = result["static"]
    assert torch.equal(static.tokens, rollout.tokens) and torch.equal(
        static.lengths, rollout.lengths
    )
    torch.testing.assert_close(static.sampler_logprobs, rollout.sampler_logprobs, rtol=0, atol=1e-5)
    mask = rollout.response_mask
    assert bool(mask.any()) and not bool((rollout.tokens[mask] == IMAGE).any())
    torch.testing.assert_close(
        rollout.sampler_logprobs.double() * mask, expected * mask, rtol=1e-5, atol=1e-5
    )
    scored = result["scored"]
    torch.testing.assert_close(
        scored["excluded"] * mask, rollout.sampler_logprobs * mask, rtol=1e-5, atol=1e-5
    )
    # without the exclusion the scorer gives the placeholder mass the sampler never draws from:
    # on-policy training would then move probability onto it unopposed
    assert float((scored["whole vocabulary"] - rollout.sampler_logprobs)[mask].abs().min()) > 1e-4
