"""A stand-in for the ``vllm`` package (which needs CUDA): the attributes the adapter uses.

``install()`` puts it into ``sys.modules``; responses are a function of each request's seed.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import sys
import types
from typing import Any

import torch


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


def modules() -> dict[str, types.ModuleType]:
    """The fake ``vllm`` and ``vllm.inputs`` modules, by name (not registered)."""
    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", loader=None)
    inputs = types.ModuleType("vllm.inputs")
    inputs.__spec__ = importlib.machinery.ModuleSpec("vllm.inputs", loader=None)
    vllm.LLM = FakeLLM  # type: ignore[attr-defined]
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs.TokensPrompt = lambda **kw: dict(kw)  # type: ignore[attr-defined]  # a TypedDict
    vllm.inputs = inputs  # type: ignore[attr-defined]
    return {"vllm": vllm, "vllm.inputs": inputs}


def install() -> types.ModuleType:
    """Register the fake modules in ``sys.modules`` (for a spawned test process); return vllm."""
    fakes = modules()
    sys.modules.update(fakes)
    return fakes["vllm"]
