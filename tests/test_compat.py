"""The CPU compat module: explicit, reversible, and honest about which patches are still needed."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

pytestmark = [pytest.mark.megatron]


def test_import_changes_nothing() -> None:
    cuda_method, type_method = torch.Tensor.cuda, torch.Tensor.type
    cpu = importlib.import_module("megatron_gndpo.compat.cpu")
    assert not cpu.is_enabled()
    assert torch.Tensor.cuda is cuda_method and torch.Tensor.type is type_method


def test_enable_and_disable_restore_everything() -> None:
    from megatron_gndpo.compat import cpu

    targets = {patch.target: (patch, patch.current()) for patch in cpu.PATCHES}
    cuda_method, type_method = torch.Tensor.cuda, torch.Tensor.type

    handle = cpu.enable()
    try:
        assert cpu.enable() is handle  # idempotent
        rotary = importlib.import_module(
            "megatron.core.models.common.embeddings.rotary_pos_embedding"
        )
        assert rotary.torch.cuda.current_device() == torch.device("cpu")
        made = rotary.torch.zeros(3, device="cuda", pin_memory=True)
        assert made.device.type == "cpu"
        assert torch.ones(2).cuda().device.type == "cpu"
        rng = importlib.import_module("megatron.core.tensor_parallel.random")
        state = rng._get_cuda_rng_state()
        assert torch.equal(state, torch.get_rng_state())
    finally:
        handle.disable()

    assert not cpu.is_enabled()
    assert torch.Tensor.cuda is cuda_method and torch.Tensor.type is type_method
    for target, (patch, original) in targets.items():
        assert patch.current() is original, f"{target} was not restored"


def test_type_names_only_for_listed_callers() -> None:
    from megatron_gndpo.compat import cpu

    handle = cpu.enable()
    try:
        assert torch.ones(1).type() == "torch.FloatTensor"  # this test module is not listed
        clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
        seen = eval("torch.ones(1).type()", vars(clip_grads))  # called from a listed module
        assert seen == "torch.cuda.FloatTensor"
    finally:
        handle.disable()


def test_torch_norms_under_sequence_parallelism_are_marked_like_apex_and_te_norms() -> None:
    """megatron's WrappedTorchNorm asserts ``not config.sequence_parallel``; enabled, it builds
    the same norm and marks its parameters ``sequence_parallel`` (finalize_model_grads sums
    their gradients over TP), and only under sequence parallelism."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_gndpo.compat import cpu

    def config(sp: bool, normalization: str) -> TransformerConfig:
        return TransformerConfig(
            num_layers=1, hidden_size=8, num_attention_heads=2, normalization=normalization,
            tensor_model_parallel_size=2, sequence_parallel=sp,
        )  # fmt: skip

    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config(True, "LayerNorm"), 8)
    handle = cpu.enable()
    try:
        kinds = (("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm))
        for normalization, kind in kinds:
            norm = WrappedTorchNorm(config(True, normalization), 8, eps=1e-6)
            assert type(norm) is kind and norm.eps == 1e-6
            params = list(norm.parameters())
            assert params and all(p.sequence_parallel is True for p in params)
            plain = WrappedTorchNorm(config(False, normalization), 8)
            assert not any(hasattr(p, "sequence_parallel") for p in plain.parameters())
    finally:
        handle.disable()
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config(True, "LayerNorm"), 8)


def test_enable_refuses_on_gpu_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_gndpo.compat import cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(RuntimeError, match="machines without CUDA"):
        cpu.enable()
    assert cpu.enable_if_no_cuda() is None
    assert not cpu.is_enabled()


def test_report_which_patches_are_still_needed() -> None:
    """Prints, for the installed megatron-core, which patches still find their CUDA assumption.

    A patch whose target disappeared fails (the module must be updated); a patch that finds no
    CUDA assumption any more raises a warning: it is a candidate for deletion.
    """
    import megatron.core

    from megatron_gndpo.compat import cpu

    statuses, unlisted = cpu.report()
    print(f"\nmegatron-core {megatron.core.__version__}: CPU compat patches")
    for s in statuses:
        print(f"  {'needed ' if s.needed else 'OBSOLETE'}  {s.target}  ({s.why})")
    print(f"  modules with CUDA assumptions not patched (paths CPU runs do not take): {unlisted}")
    obsolete = [s.target for s in statuses if not s.needed]
    if obsolete:
        warnings.warn(f"compat patches no longer needed: {obsolete}", stacklevel=1)
    assert len(statuses) == len(cpu.PATCHES)


def test_checkpoint_writer_results_stay_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's writer would start a spawned manager process for its results queue (it
    outlived a killed rank: tests/test_slurm.py); after the compat call it gets a thread queue,
    and importing the compat module changes nothing."""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    children = set(multiprocessing.active_children())
    saving = importlib.import_module("megatron_gndpo.compat.saving")
    assert filesystem_async._results_queue is None
    saving.keep_write_results_in_process()
    seeded = filesystem_async.get_write_results_queue()
    assert type(seeded) is queue.Queue and set(multiprocessing.active_children()) == children
    saving.keep_write_results_in_process()  # idempotent
    assert filesystem_async.get_write_results_queue() is seeded
