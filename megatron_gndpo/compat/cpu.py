"""Run megatron-core on a machine without CUDA (tests, the embedded demo, ``plan``).

megatron-core assumes CUDA in a few dozen places: ``torch.cuda.current_device()`` used as a
device, CUDA RNG state get/set, ``torch.cuda.synchronize``/``set_device``, literal
``device="cuda"`` and ``pin_memory=True`` in tensor factories, ``Tensor.cuda()``, and
``torch.cuda.Event``/``Stream``. It also leans on what a GPU machine brings besides: Apex or
Transformer Engine norms (sequence parallelism) and NCCL (uneven all-gathers). This module
redirects exactly those, and nothing else:

- **module redirects**: in each listed megatron module the global name ``torch`` is replaced by a
  proxy that forwards everything to torch except ``torch.cuda`` (a CPU stand-in) and the tensor
  factories (``device="cuda"`` becomes ``"cpu"``, ``pin_memory`` is dropped);
- **function patches**: megatron's private CUDA RNG helpers become the CPU generator's;
- **tensor patches**: ``Tensor.cuda()`` returns the tensor itself (on a CPU-only machine it could
  only raise); ``Tensor.type()``, called from a listed megatron module, names CPU tensors as
  their CUDA types (the distributed optimizer and gradient clipping compare those names);
- **sequence-parallel torch norms**: without Apex or Transformer Engine megatron's local spec
  builds its norms with ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel``.
  A norm is per token, so under sequence parallelism it needs nothing but what Apex's
  ``FusedLayerNorm`` and TE's norms do: mark its parameters ``sequence_parallel = True``, so
  that megatron's ``finalize_model_grads`` sums their gradients (each TP rank's covers its own
  slice of the sequence) over the TP group. The q/k norms get the mark too, as TE's do (their
  gradients are summed over TP with or without sequence parallelism: each rank's covers its
  own heads);
- **uneven all-gathers**: with expert tensor parallelism the MoE token dispatcher gathers
  unequal token counts from the TP ranks through ``torch.distributed.all_gather`` with a list
  of unequal tensors, which NCCL accepts and gloo rejects; the gather pads to the longest.

Nothing happens on import. :func:`enable` applies every patch and returns a handle whose
``disable()`` restores the originals; it refuses to run where CUDA is available, because there
megatron-core needs none of this. :func:`report` tells, for the installed megatron-core, which
patches still find the assumption they exist for (a patch that no longer does is a candidate for
deletion), and which megatron modules outside the list mention CUDA.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

_CPU = torch.device("cpu")

# Source patterns that mark a CUDA assumption a CPU run trips over.
_CUDA_MARKERS = re.compile(
    r"torch\.cuda\.(current_device|synchronize|set_device|Event|Stream|current_stream|stream|"
    r"manual_seed|get_rng_state|set_rng_state|default_generators|empty_cache|FloatTensor)"
    r"|device=['\"]cuda['\"]|pin_memory=True|\.cuda\(\)"
)

# Tensor factories whose ``device=`` / ``pin_memory=`` arguments are rewritten.
_FACTORIES = (
    "tensor", "as_tensor", "empty", "zeros", "ones", "full", "arange", "randn", "rand",
    "randint", "empty_like", "zeros_like", "ones_like", "full_like", "eye", "linspace",
    "empty_strided",
)  # fmt: skip


def _to_cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):  # a CUDA ordinal from torch.cuda.current_device()
        return _CPU
    if isinstance(device, str | torch.device) and torch.device(device).type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapper


class _NullEvent:
    """Stands in for ``torch.cuda.Event``: on CPU every op is finished when it returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _NullStream(_NullEvent):
    """Stands in for ``torch.cuda.Stream``; usable as a context manager."""

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        # megatron's alltoall MoE token dispatcher records an event on its copy stream
        return event if event is not None else _NullEvent()

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _CpuCuda:
    """``torch.cuda`` as megatron-core sees it inside redirected modules on a CPU machine."""

    Event = _NullEvent
    Stream = _NullStream

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _NullStream:
        return _NullStream()

    @staticmethod
    def stream(*args: Any, **kwargs: Any) -> _NullStream:
        return _NullStream()

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def set_device(*args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def memory_allocated(*args: Any, **kwargs: Any) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(*args: Any, **kwargs: Any) -> int:
        return 0


class _CpuTorch(types.ModuleType):
    """The ``torch`` module with its CUDA entry points redirected to the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


# --------------------------------------------------------------------------------------------
# The patches


@dataclasses.dataclass(frozen=True)
class Patch:
    """One redirect of a CUDA assumption in megatron-core.

    ``target`` is ``"module"``, ``"module:attr"`` or ``"module:Class.attr"``. ``kind`` says
    what is redirected: ``"torch"`` replaces the module's global ``torch`` with the CPU proxy,
    ``"function"`` replaces ``attr`` with ``replacement()``, ``"wrap"`` with
    ``replacement(original)``, ``"type_names"`` makes ``Tensor.type()`` called from the
    module return CUDA type names. ``why`` says what fails on CPU without it.
    """

    target: str
    why: str
    kind: str = "torch"
    replacement: Callable[..., Any] | None = None
    marker: str = ""
    """A regex of the assumption in the target's source when it is not a CUDA call (for
    :meth:`still_needed`); empty: the CUDA markers."""

    @property
    def module_name(self) -> str:
        return self.target.split(":")[0]

    def resolve(self) -> tuple[Any, str]:
        """``(owner, attr)``: the module (or class in it) and the name this patch replaces."""
        module = importlib.import_module(self.module_name)
        path = self.target.split(":")[1] if ":" in self.target else "torch"
        *classes, attr = path.split(".")
        owner: Any = module
        for name in classes:
            owner = getattr(owner, name, None)
        if owner is None or not hasattr(owner, attr):
            raise AttributeError(
                f"megatron-core changed: {self.module_name} has no {path!r}; update "
                f"megatron_gndpo/compat/cpu.py for this version"
            )
        return owner, attr

    def current(self) -> Any:
        """What the target holds now (a class attribute as stored: a staticmethod stays one)."""
        owner, attr = self.resolve()
        return vars(owner)[attr] if isinstance(owner, type) else getattr(owner, attr)

    def apply(self) -> Callable[[], None]:
        """Apply; return the function that undoes it."""
        owner, attr = self.resolve()
        if self.kind == "type_names":
            _TYPE_NAME_CALLERS.add(owner.__name__)
            return lambda: _TYPE_NAME_CALLERS.discard(owner.__name__)
        original = self.current()
        new: Any
        if self.kind == "torch":
            new = _CPU_TORCH
        elif self.kind == "wrap":
            new = self.replacement(getattr(owner, attr))  # type: ignore[misc]
        else:
            new = self.replacement()  # type: ignore[misc]
        if isinstance(original, staticmethod):  # e.g. __new__: keep it static
            new = staticmethod(new)
        setattr(owner, attr, new)
        return lambda: setattr(owner, attr, original)

    def still_needed(self) -> bool:
        """Whether the installed megatron-core still has the CUDA assumption this patch covers."""
        owner, attr = self.resolve()
        source = inspect.getsource(getattr(owner, attr) if ":" in self.target else owner)
        markers = _CUDA_TYPE_NAMES if self.kind == "type_names" else _CUDA_MARKERS
        if self.marker:
            markers = re.compile(self.marker)
        return bool(markers.search(source))


# Tensor.type() compared with CUDA type names.
_CUDA_TYPE_NAMES = re.compile(r"\.type\(\)\s*(==|in)\s*\[?\s*['\"]torch\.cuda\.")
_TYPE_NAME_CALLERS: set[str] = set()
_ORIGINAL_TENSOR_TYPE = torch.Tensor.type


def _tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    name = _ORIGINAL_TENSOR_TYPE(self, *args, **kwargs)
    if args or kwargs or self.device.type != "cpu":
        return name
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller in _TYPE_NAME_CALLERS and name.startswith("torch."):
        return "torch.cuda." + name.removeprefix("torch.")
    return name


def _cpu_get_rng_state(*args: Any, clone: bool = False, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    # megatron-core's version converts only CUDA tensors, so on CPU the all-to-all split sizes
    # stay tensors where all_to_all_single wants lists (TypeError at expert parallelism > 1).
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.cpu().numpy()
    return tensor


class _WithoutSequenceParallel:
    """A TransformerConfig read as if sequence parallelism were off (every other field as is)."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return False if name == "sequence_parallel" else getattr(self._config, name)


def _sequence_parallel_torch_norm(original_new: Callable[..., Any]) -> Callable[..., Any]:
    """``WrappedTorchNorm.__new__`` that builds the same torch norm under sequence parallelism
    and marks its parameters as Apex's ``FusedLayerNorm`` and TE's norms do (module docstring)."""

    def new(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        norm = original_new(cls, _WithoutSequenceParallel(config), hidden_size, *args, **kwargs)
        for param in norm.parameters():
            # finalize_model_grads all-reduces these over TP (config.sequence_parallel is set)
            param.sequence_parallel = True
        return norm

    return new


def _padded_uneven_gather(original: Callable[..., Any]) -> Callable[..., Any]:
    """``mappings._gather_along_first_dim`` for unequal ``output_split_sizes`` on gloo: each
    rank's rows padded to the longest, gathered evenly, the padding dropped (same result)."""

    def gather(
        input_: torch.Tensor,
        group: Any,
        output_split_sizes: list[int] | None = None,
        use_global_buffer: bool = False,
    ) -> torch.Tensor:
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = original(padded, group, None, False)  # [world * longest, ...]
        return torch.cat(
            [gathered[r * longest : r * longest + n] for r, n in enumerate(output_split_sizes)]
        )

    return gather


_RANDOM = "megatron.core.tensor_parallel.random"
_MOE = "megatron.core.transformer.moe"
# moe_utils.maybe_move_tensor_to_cpu converts only tensors on CUDA
_CUDA_ONLY_MOVE = r"if torch\.is_tensor\(tensor\) and tensor\.is_cuda"
# an all_gather into a list of (possibly unequal) tensors
_LIST_ALL_GATHER = r"torch\.distributed\.all_gather\(output_tensor_list"
# WrappedTorchNorm refuses sequence parallelism
_NO_SEQUENCE_PARALLEL = r"assert\s*\(?\s*not config\.sequence_parallel"

PATCHES: tuple[Patch, ...] = (
    Patch(f"{_RANDOM}:_get_cuda_rng_state", "indexes torch.cuda.default_generators",
          "function", lambda: _cpu_get_rng_state),
    Patch(f"{_RANDOM}:_set_cuda_rng_state", "indexes torch.cuda.default_generators",
          "function", lambda: _cpu_set_rng_state),
    Patch(_RANDOM, "model_parallel_cuda_manual_seed and the tracker seed the CUDA generator"),
    Patch("megatron.core.models.common.embeddings.rotary_pos_embedding",
          "inv_freq and frequencies are built on torch.cuda.current_device()"),
    Patch("megatron.core.tensor_parallel.layers",
          "weights and all-gather buffers are allocated on torch.cuda.current_device()"),
    Patch("megatron.core.tensor_parallel.mappings",
          "gather/scatter buffers are allocated on torch.cuda.current_device()"),
    Patch("megatron.core.tensor_parallel.data", "broadcast buffers use the current CUDA device"),
    Patch("megatron.core.tensor_parallel.utils", "split buffers use torch.cuda.current_device()"),
    Patch("megatron.core.utils", "global memory buffer and helpers allocate on CUDA"),
    Patch("megatron.core.pipeline_parallel.schedules",
          "token counts are created with device='cuda'"),
    Patch("megatron.core.pipeline_parallel.p2p_communication",
          "receive buffers are allocated on CUDA and sends call torch.cuda.synchronize()"),
    Patch("megatron.core.pipeline_parallel.utils", "pipeline helpers use CUDA streams"),
    Patch("megatron.core.distributed.distributed_data_parallel",
          "gradient buffers are allocated on torch.cuda.current_device()"),
    Patch("megatron.core.distributed.param_and_grad_buffer",
          "parameter and gradient buffers are allocated on CUDA"),
    Patch("megatron.core.optimizer.optimizer", "found-inf and grad-norm tensors are made on CUDA"),
    Patch("megatron.core.optimizer.clip_grads", "the grad-norm accumulator is made on CUDA"),
    Patch("megatron.core.optimizer.distrib_optimizer", "shard buffers are allocated on CUDA"),
    Patch("megatron.core.optimizer.grad_scaler", "loss-scale tensors are made on CUDA"),
    Patch("megatron.core.optimizer.optimizer", "fp32/bf16 params are told apart by CUDA type name",
          "type_names"),
    Patch("megatron.core.optimizer.distrib_optimizer",
          "shards are built only for parameters whose type name is torch.cuda.*", "type_names"),
    Patch("megatron.core.optimizer.clip_grads", "asserts grads are torch.cuda.FloatTensor",
          "type_names"),
    Patch("megatron.core.dist_checkpointing.exchange_utils",
          "checkpoint shards are exchanged through CUDA tensors"),
    Patch("megatron.core.dist_checkpointing.strategies.filesystem_async",
          "the writer calls torch.cuda.synchronize() before copying tensors"),
    Patch("megatron.core.dist_checkpointing.strategies.state_dict_saver",
          "save verification flags are made with device='cuda'"),
    Patch("megatron.core.dist_checkpointing.strategies.async_utils",
          "the save caller synchronises CUDA and exchanges flags on the current device"),
    Patch("megatron.core.dist_checkpointing.tensor_aware_state_dict",
          "tensors are synchronised with torch.cuda.synchronize() before saving"),
    Patch("megatron.core.dist_checkpointing.strategies.fully_parallel",
          "load exchange allocates on torch.cuda.current_device()"),
    Patch("megatron.core.transformer.transformer_layer", "layer offsets use CUDA tensors"),
    Patch("megatron.core.transformer.utils", "the default causal mask is built with device='cuda'"),
    Patch("megatron.core.transformer.attention", "inference KV buffers use the current device"),
    Patch("megatron.core.transformer.dot_product_attention",
          "inference and context buffers use the current device"),
    Patch("megatron.core.models.gpt.gpt_model", "inference logits buffers use the current device"),
    Patch("megatron.core.models.multimodal.llava_model",
          "LLaVAModel.forward makes its empty sound tensors on torch.cuda.current_device()"),
    Patch("megatron.core.models.common.embeddings.rope_utils",
          "context-parallel index tensors are pinned"),
    Patch("megatron.core.rerun_state_machine", "validation flags are made with device='cuda'"),
    Patch("megatron.core.timers", "timers synchronise CUDA and gather on the current device"),
    Patch(f"{_MOE}.router", "router weights and routing buffers use torch.cuda.current_device()"),
    Patch(f"{_MOE}.token_dispatcher",
          "the alltoall dispatcher copies split sizes on a torch.cuda.Stream()"),
    Patch(f"{_MOE}.moe_utils:maybe_move_tensor_to_cpu",
          "all-to-all split sizes of CPU tensors are not made lists", "function",
          lambda: _cpu_maybe_move_tensor_to_cpu, _CUDA_ONLY_MOVE),
    Patch(f"{_MOE}.token_dispatcher:maybe_move_tensor_to_cpu",
          "the dispatcher's imported copy of moe_utils.maybe_move_tensor_to_cpu", "function",
          lambda: _cpu_maybe_move_tensor_to_cpu, _CUDA_ONLY_MOVE),
    Patch("megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",
          "the torch norms of the local spec (no Apex/TE) refuse sequence parallelism", "wrap",
          _sequence_parallel_torch_norm, _NO_SEQUENCE_PARALLEL),
    Patch("megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
          "the MoE dispatcher's expert-TP gather of unequal token counts fails on gloo", "wrap",
          _padded_uneven_gather, _LIST_ALL_GATHER),
)  # fmt: skip

_CPU_TORCH = _CpuTorch()


class _QuietForkWarning(logging.Filter):
    # On CPU the "CUDA" generator the RNG tracker forks IS the CPU generator, so the tracker's
    # check that the CPU state did not change inside fork() always fires. It is expected here.
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _tensor_cuda_noop(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


@dataclasses.dataclass
class CpuCompat:
    """Handle returned by :func:`enable`; ``disable()`` restores everything it changed."""

    _undo: list[Callable[[], None]]

    def disable(self) -> None:
        global _ACTIVE
        while self._undo:
            self._undo.pop()()
        _ACTIVE = None


_ACTIVE: CpuCompat | None = None


def enable() -> CpuCompat:
    """Redirect megatron-core's CUDA assumptions to the CPU. Idempotent; never call it on GPUs."""
    global _ACTIVE
    if _ACTIVE is not None:
        return _ACTIVE
    if torch.cuda.is_available():
        raise RuntimeError(
            "megatron_gndpo.compat.cpu.enable() is for machines without CUDA; this one has "
            f"{torch.cuda.device_count()} GPU(s). Call enable_if_no_cuda() in entry points."
        )
    undo: list[Callable[[], None]] = []
    for patch in PATCHES:
        undo.append(patch.apply())
    original_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = _tensor_cuda_noop  # type: ignore[method-assign,assignment]
    undo.append(lambda: setattr(torch.Tensor, "cuda", original_cuda))
    torch.Tensor.type = _tensor_type  # type: ignore[method-assign,assignment]
    undo.append(lambda: setattr(torch.Tensor, "type", _ORIGINAL_TENSOR_TYPE))
    fork_filter = _QuietForkWarning()
    random_logger = logging.getLogger(_RANDOM)
    random_logger.addFilter(fork_filter)
    undo.append(lambda: random_logger.removeFilter(fork_filter))
    _ACTIVE = CpuCompat(undo)
    return _ACTIVE


def enable_if_no_cuda() -> CpuCompat | None:
    """What entry points call: enable on a CPU-only machine, do nothing where CUDA exists."""
    return None if torch.cuda.is_available() else enable()


def is_enabled() -> bool:
    return _ACTIVE is not None


@dataclasses.dataclass(frozen=True)
class PatchStatus:
    target: str
    why: str
    needed: bool


def report() -> tuple[list[PatchStatus], list[str]]:
    """Which patches the installed megatron-core still needs, and unpatched CUDA mentions.

    Returns ``(statuses, unlisted)`` where ``unlisted`` names imported ``megatron.core`` modules
    outside the patch list whose source still has a CUDA assumption (paths a CPU run has not
    exercised; a new failure on CPU is likely to be in one of them).
    """
    statuses = [PatchStatus(p.target, p.why, p.still_needed()) for p in PATCHES]
    listed = {p.module_name for p in PATCHES}
    unlisted = []
    for name, module in sorted(_megatron_modules()):
        if name in listed:
            continue
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        if _CUDA_MARKERS.search(source):
            unlisted.append(name)
    return statuses, unlisted


def _megatron_modules() -> Iterator[tuple[str, types.ModuleType]]:
    import sys

    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and isinstance(module, types.ModuleType):
            yield name, module
