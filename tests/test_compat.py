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

    targets = {}
    for patch in cpu.PATCHES:
        module = importlib.import_module(patch.module_name)
        attr = patch.target.split(":")[1] if ":" in patch.target else "torch"
        targets[patch.target] = (module, attr, getattr(module, attr))
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
    for target, (module, attr, original) in targets.items():
        assert getattr(module, attr) is original, f"{target} was not restored"


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
