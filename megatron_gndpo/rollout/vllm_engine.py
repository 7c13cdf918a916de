"""Rollouts on vLLM's offline engine, colocated with the trainer (``rollout.engine=vllm``).

Every trainer rank builds one :class:`VLLMGenerator`, together (vLLM creates its groups with
collectives). The engine runs inside the trainer's process (``distributed_executor_backend=
"external_launcher"``): vLLM joins the job's torch.distributed world and forms its
tensor-parallel groups from consecutive ranks, so all ranks of one vLLM TP group must submit
the same requests (they do when they are one trainer TP group: megatron's rank order puts TP
fastest). In process, weights reach the engine without serialisation. One training step:

    generator.wake_up()
    sync_weights(generator, student, groups, model_cfg, family=...)   # the updated policy
    rollout = generator.generate(prompts, params, seeds=seeds)
    generator.sleep()                                                  # GPU memory to training

Choices, each for a reason:

- ``load_format="dummy"`` and ``skip_tokenizer_init=True``: the engine needs only a
  ``config.json`` (:func:`write_engine_config`); its weights come from the first sync (generate
  refuses to run before one) and token ids go in and out, so no tokenizer is loaded.
- ``logprobs_mode="processed_logprobs"`` with ``logprobs=0``: the reported log-prob is that of
  the sampled token under the distribution actually sampled from (after temperature, top-k,
  top-p), as the built-in generator reports; vLLM's default is the untempered model's.
- one request per (prompt i, sample k) seeded from ``(seeds[i], k)`` as
  :class:`~megatron_gndpo.rollout.base.RowStreams` does: a sample does not depend on the batch.
- the prefix cache is reset after every weight load: cached prompt KV from the old weights
  must not be reused.

The vLLM-facing code is the constructor, :meth:`VLLMGenerator.generate`'s engine call and
:func:`_load_on_worker`; request building and output conversion are pure functions.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_gndpo.checkpoint import hf_mapping
from megatron_gndpo.config.schema import Dtype, ModelConfig, RolloutConfig
from megatron_gndpo.config.validate import require_package
from megatron_gndpo.rollout.base import Rollout, SamplingParams

_VLLM_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# vLLM's "no top-k" value (0 means the same in ours).
_VLLM_NO_TOP_K = -1


def row_seed(seed: int, k: int) -> int:
    """The seed of sample ``k`` of a prompt seeded ``seed`` (RowStreams' formula)."""
    return (seed * 1_000_003 + k) % (2**63)


@dataclasses.dataclass(frozen=True)
class Request:
    """One vLLM request: the prompt's token ids and ``vllm.SamplingParams`` keyword arguments."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]


def build_requests(
    prompts: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
) -> list[Request]:
    """Requests in row order (prompt i's samples contiguous), one sample each."""
    if len(seeds) != len(prompts):
        raise ValueError(f"need one seed per prompt, got {len(seeds)} for {len(prompts)}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (check the chat template)")
    requests = []
    for prompt, seed in zip(prompts, seeds, strict=True):
        for k in range(params.samples_per_prompt):
            sampling = dict(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else _VLLM_NO_TOP_K,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.stop_token_ids),
                logprobs=0,  # the sampled token's log-prob only
                seed=row_seed(seed, k),
                detokenize=False,
            )
            requests.append(Request([int(t) for t in prompt], sampling))
    return requests


def rollout_from_outputs(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Any],
    *,
    samples_per_prompt: int,
    pad_id: int,
) -> Rollout:
    """A right-padded :class:`Rollout` from vLLM ``RequestOutput``s in request order.

    Reads ``outputs[r].outputs[0]``: ``token_ids`` (the stop token included when it stopped),
    ``logprobs`` (per generated token, a dict ``token id -> Logprob``) and ``finish_reason``
    (``"stop"`` is finished; ``"length"`` is truncated).
    """
    rows = [list(p) for p in prompts for _ in range(samples_per_prompt)]
    if len(outputs) != len(rows):
        raise ValueError(f"expected {len(rows)} vLLM outputs (one per row), got {len(outputs)}")
    responses, logprobs, finished = [], [], []
    for row, output in enumerate(outputs):
        completion = output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        per_token = completion.logprobs
        got = 0 if per_token is None else len(per_token)
        if got != len(ids):
            raise ValueError(
                f"row {row}: vLLM returned log-probs for {got} of {len(ids)} tokens; requests "
                "must ask for logprobs=0"
            )
        responses.append(ids)
        logprobs.append([float(step[t].logprob) for step, t in zip(per_token, ids, strict=True)])
        finished.append(completion.finish_reason == "stop")
    prompt_lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    lengths = prompt_lengths + torch.tensor([len(r) for r in responses], dtype=torch.long)
    width = int(lengths.max())
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    sampler_logprobs = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, (prompt, response, lp) in enumerate(zip(rows, responses, logprobs, strict=True)):
        n, m = len(prompt), len(response)
        tokens[i, : n + m] = torch.tensor(prompt + response, dtype=torch.long)
        sampler_logprobs[i, n : n + m] = torch.tensor(lp, dtype=torch.float32)
    return Rollout(
        tokens=tokens,
        prompt_lengths=prompt_lengths,
        lengths=lengths,
        sampler_logprobs=sampler_logprobs,
        prompt_index=torch.arange(len(prompts)).repeat_interleave(samples_per_prompt),
        finished=torch.tensor(finished, dtype=torch.bool),
    )


def engine_args(
    rollout: RolloutConfig,
    model_dir: str | Path,
    *,
    tensor_parallel_size: int,
    dtype: Dtype,
    seed: int,
    load_format: str,
    max_model_len: int | None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for a colocated engine (see the module docstring)."""
    return dict(
        model=str(model_dir),
        tensor_parallel_size=tensor_parallel_size,
        dtype=_VLLM_DTYPES[dtype],
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        enable_sleep_mode=True,
        distributed_executor_backend="external_launcher",
        load_format=load_format,
        skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs",
        max_model_len=max_model_len or rollout.max_prompt_length + rollout.max_response_length,
        seed=seed,
    )


def write_engine_config(
    out_dir: str | Path, model_cfg: ModelConfig, *, family: str, dtype: Dtype = "bf16"
) -> Path:
    """Write the ``config.json`` a dummy-loaded engine starts from; return ``out_dir``."""
    config = hf_mapping.hf_config_from_model(
        dataclasses.replace(model_cfg, params_dtype=dtype), family
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _load_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on vLLM's worker (in this process): load full HF-named tensors into its model."""
    worker.model_runner.get_model().load_weights(weights=weights)


class VLLMGenerator:
    """:class:`~megatron_gndpo.rollout.base.Generator` and ``WeightReceiver`` over ``vllm.LLM``.

    ``model_dir`` holds the model's ``config.json`` (:func:`write_engine_config`), or a full
    Hugging Face model with ``load_format="auto"``. ``tensor_parallel_size`` is vLLM's own TP
    (consecutive ranks of the job); ``dtype`` the engine's weights.
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        model_dir: str | Path,
        *,
        pad_id: int,
        tensor_parallel_size: int = 1,
        dtype: Dtype = "bf16",
        seed: int = 0,
        load_format: str = "dummy",
        max_model_len: int | None = None,
    ) -> None:
        require_package(
            "vllm", what="rollout.engine=vllm", extra="vllm", instead="set rollout.engine=builtin"
        )
        import vllm

        self.pad_id = pad_id
        self.args = engine_args(
            rollout, model_dir, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            seed=seed, load_format=load_format, max_model_len=max_model_len,
        )  # fmt: skip
        self.llm = vllm.LLM(**self.args)
        self.has_weights = load_format != "dummy"
        self.asleep = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the engine (``WeightReceiver``); any subset at once."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() before a weight sync")
        self.llm.collective_rpc(_load_on_worker, args=(list(weights),))
        self.llm.reset_prefix_cache()  # prompt KV cached under the old weights is stale
        self.has_weights = True

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory for training (level 1: weights to CPU, KV cache gone)."""
        self.llm.sleep(level=level)
        self.asleep = True

    def wake_up(self) -> None:
        self.llm.wake_up()
        self.asleep = False

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, seeds: Sequence[int]
    ) -> Rollout:
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() before generating")
        if not self.has_weights:
            raise RuntimeError(
                "the vLLM engine holds dummy weights: run sync_weights() into it before the "
                "first rollout"
            )
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        requests = build_requests(prompts, params, seeds)
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests],
            [VLLMSamplingParams(**r.sampling) for r in requests],
            use_tqdm=False,
        )
        return rollout_from_outputs(
            prompts, outputs, samples_per_prompt=params.samples_per_prompt, pad_id=self.pad_id
        )
