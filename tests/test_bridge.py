"""Round trips against Megatron-Bridge itself (0.6.2 on CPU), in both directions, for tiny
Qwen2, Qwen3 and Llama models (2 layers, hidden 64, vocabulary 1000, untied, fp32):

- HF -> Bridge (``to_megatron_provider`` + ``save_megatron_model``) -> our teacher: the checkpoint
  Bridge writes (its tracker, 1000 embedding rows) loads through ``load_checkpoint`` (padded to
  our 1024 rows) and scores transformers' log-probs within ``LOGP_TOL``; our ``convert
  mcore-to-hf`` exports it with no ``--model-config`` (the architecture from Bridge's
  ``run_config.yaml``): every tensor equal to the source, transformers' log-probs within
  ``LOGP_TOL``;
- HF -> ours (``convert hf-to-mcore``) -> Bridge ``AutoBridge.export_ckpt`` -> HF: every tensor
  equal to our own ``convert mcore-to-hf`` export and to the source.

The Bridge tier: Bridge pins transformers<=5.12.1, so its side runs in its own environment
(``scripts/ci/install_bridge_cpu.sh VENV``, which borrows the main venv's torch), as a subprocess
of ``docs/interop/bridge_side.py`` (what it takes to run Bridge on a CPU is there and in
``docs/interop/README.md``); our side runs here. The Bridge venv is ``MEGATRON_GNDPO_BRIDGE_VENV``
or ``.venv-bridge`` beside this checkout. The default ``pytest`` deselects these tests
(``-m "not bridge"`` in pyproject.toml): they run with ``pytest -m bridge``, as ``.ci/run`` does.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
BRIDGE_SIDE = ROOT / "docs" / "interop" / "bridge_side.py"
BRIDGE_VENV = Path(os.environ.get("MEGATRON_GNDPO_BRIDGE_VENV", ROOT / ".venv-bridge"))
BRIDGE_PYTHON = BRIDGE_VENV / "bin" / "python"
VOCAB = 1000
# fp32 end to end; both sides are megatron-core's local layers over the same weights.
LOGP_TOL = 1e-4
FAMILIES = ["qwen2", "qwen3", "llama"]

pytestmark = [
    pytest.mark.bridge,
    pytest.mark.megatron,
    pytest.mark.skipif(
        not BRIDGE_PYTHON.exists(),
        reason=f"the Megatron-Bridge venv is not installed at {BRIDGE_VENV}: "
        "scripts/ci/install_bridge_cpu.sh VENV (or set MEGATRON_GNDPO_BRIDGE_VENV)",
    ),
]


def _bridge(*steps: str) -> None:
    """bridge_side.py's ``WORK STEP ARGS [+ WORK STEP ARGS ...]`` in one process of the Bridge
    venv, this checkout importable (compat.cpu)."""
    for _attempt in range(3):  # the free port may be taken before Bridge's gloo world binds it
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # fmt: skip
        result = subprocess.run(
            [str(BRIDGE_PYTHON), str(BRIDGE_SIDE), *steps],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        if "EADDRINUSE" not in result.stderr:
            break
    assert result.returncode == 0, f"bridge_side.py {' '.join(steps)}:\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def works(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per family: a tiny random HF model in WORK/hf, written by transformers 5.12.1 (Bridge's),
    and Bridge's import of it (``to_megatron_provider`` + ``save_megatron_model``: its trackers,
    ``run_config.yaml``, 1000 embedding rows) in WORK/bridge_ckpt; all in one Bridge process."""
    base = tmp_path_factory.mktemp("bridge")
    works = {family: base / family for family in FAMILIES}
    _bridge(*_joined([str(work), "prepare", family] for family, work in works.items()))
    return works


def _joined(steps: Iterable[list[str]]) -> list[str]:
    """bridge_side.py's steps, one process: ``W1 STEP ARGS + W2 STEP ARGS``."""
    out: list[str] = []
    for step in steps:
        out += ["+", *step] if out else step
    return out


@pytest.fixture(params=FAMILIES)
def hf_model(
    request: pytest.FixtureRequest, works: dict[str, Path], ours: dict[str, torch.Tensor]
) -> Path:
    """WORK of one family (named after it), our side already run on it (:func:`ours`)."""
    return works[request.param]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _our_sides(
    rank: int, world: int, works: dict[str, str], tokens: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Everything of ours on every family, in one process (each start costs ~10 s of imports):

    - Bridge's checkpoint loaded as our teacher: its log-probs ``[b, s, v]`` (returned by family);
    - HF -> ours (``convert hf-to-mcore``, WORK/ours_ckpt) -> HF (WORK/ours_export);
    - our ``convert mcore-to-hf`` CLI on Bridge's checkpoint, no --model-config
      (WORK/ours_export_of_bridge); last, since the CLI ends the process's world when done.
    """
    from megatron_gndpo.checkpoint import convert_cli, hf_mapping
    from megatron_gndpo.checkpoint.convert import (
        convert_hf_to_mcore,
        convert_mcore_to_hf,
        read_hf_config,
    )
    from megatron_gndpo.checkpoint.dist import load_checkpoint
    from megatron_gndpo.compat import cpu
    from megatron_gndpo.config.schema import ParallelConfig
    from megatron_gndpo.models.gpt import build_teacher
    from megatron_gndpo.parallel.groups import ParallelLayout, build_student_groups

    cpu.enable()
    groups = build_student_groups(ParallelLayout(1), seed=1)
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    logprobs = {}
    for family, work in works.items():
        model = hf_mapping.model_config_from_hf(read_hf_config(f"{work}/hf"))
        teacher = build_teacher(model, ParallelConfig(), groups)
        load_checkpoint(f"{work}/bridge_ckpt", teacher, vocab_size=model.vocab_size)
        with torch.no_grad():
            logits = teacher(tokens, positions, None)  # [b, s, padded v]
        logprobs[family] = logits[..., :VOCAB].double().log_softmax(-1)
        del teacher
        convert_hf_to_mcore(
            f"{work}/hf", f"{work}/ours_ckpt", groups=groups, parallel=ParallelConfig()
        )
        convert_mcore_to_hf(f"{work}/ours_ckpt", f"{work}/ours_export")
    for work in works.values():
        convert_cli.mcore_to_hf_main(
            ["--mcore-dir", f"{work}/bridge_ckpt", "--out", f"{work}/ours_export_of_bridge"]
        )
    return logprobs


@pytest.fixture(scope="module")
def ours(works: dict[str, Path]) -> dict[str, torch.Tensor]:
    """:func:`_our_sides` on each family's models: our teacher's log-probs of :func:`_tokens`."""
    assert not any((w / "bridge_ckpt" / "model_config.yaml").exists() for w in works.values())
    paths = {family: str(work) for family, work in works.items()}
    [logprobs] = run_distributed(_our_sides, 1, args=(paths, _tokens()), timeout_s=300)
    return logprobs


@pytest.fixture(scope="module")
def bridge_exports(works: dict[str, Path], ours: dict[str, torch.Tensor]) -> dict[str, Path]:
    """Bridge's ``export_ckpt`` of our checkpoint of each family (WORK/ours_ckpt) in
    WORK/bridge_export, all in one Bridge process."""
    _bridge(*_joined(
        [str(w), "export", str(w / "ours_ckpt"), str(w / "bridge_export")] for w in works.values()
    ))  # fmt: skip
    return {family: work / "bridge_export" for family, work in works.items()}


def _hf_logprobs(work: Path, tokens: torch.Tensor, name: str = "hf") -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(work / name, dtype=torch.float32)
    with torch.no_grad():
        return hf.eval()(input_ids=tokens).logits.double().log_softmax(-1)


def test_bridge_import_loads_as_our_teacher(hf_model: Path, ours: dict[str, torch.Tensor]) -> None:
    diff = (ours[hf_model.name] - _hf_logprobs(hf_model, _tokens())).abs().max().item()
    print(
        f"{hf_model.name}: Bridge import as our teacher vs transformers, max |dlogp| = {diff:.3g}"
    )
    assert diff < LOGP_TOL


def test_bridge_exports_our_checkpoint(hf_model: Path, bridge_exports: dict[str, Path]) -> None:
    from safetensors.torch import load_file

    source = load_file(hf_model / "hf" / "model.safetensors")
    mine = load_file(hf_model / "ours_export" / "model.safetensors")
    bridge = load_file(bridge_exports[hf_model.name] / "model.safetensors")
    assert set(bridge) == set(mine) == set(source)
    assert bridge["model.embed_tokens.weight"].shape == (VOCAB, 64)  # our padding rows trimmed
    differ = [k for k in source if not torch.equal(bridge[k], mine[k])]
    assert not differ, f"Bridge's export of our checkpoint differs from ours in {differ}"
    assert all(torch.equal(bridge[k], source[k]) for k in source)


def test_our_export_of_a_bridge_checkpoint(hf_model: Path) -> None:
    """`convert mcore-to-hf` on Bridge's checkpoint, no --model-config: the architecture from its
    run_config.yaml, the family from the HF model it names (hf_model_id)."""
    from safetensors.torch import load_file

    out = hf_model / "ours_export_of_bridge"
    source = load_file(hf_model / "hf" / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(source)
    differ = [k for k in source if not torch.equal(exported[k], source[k])]
    assert not differ, f"our export of Bridge's checkpoint differs from the source in {differ}"
    tokens = _tokens()
    diff = (_hf_logprobs(hf_model, tokens, out.name) - _hf_logprobs(hf_model, tokens)).abs().max()
    print(f"{hf_model.name}: Bridge checkpoint -> our export vs the source, max |dlogp| {diff:.3g}")
    assert diff.item() < LOGP_TOL
