"""Write pip constraints that hold the base image's compiled torch stack at its installed versions.

    python pin_container_packages.py OUT [NAME==VERSION ...]

An NGC PyTorch image builds torch, Transformer Engine, apex and flash-attn from source against one
CUDA and one torch. A later ``pip install`` that replaces torch breaks them with undefined-symbol
errors at import time, and nothing during the build notices. vLLM's wheels pin one exact PyPI torch
(vllm 0.25.0 requires torch==2.11.0), so ``pip install vllm`` does exactly that. With these packages
pinned as constraints, such an install becomes a resolver error during the build instead.

Only packages with compiled code built against torch are pinned: pinning every package in the
image (what NGC's own /etc/pip/constraint.txt does) also blocks ordinary pure-Python upgrades that
megatron-core, vLLM or modelopt need. Extra ``NAME==VERSION`` arguments (the image's chosen
versions of its own dependencies) are appended, so one file records every pin of the image.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

# Distributions compiled against the image's torch (normalised names, PEP 503).
_TORCH_STACK = re.compile(
    r"^(torch|torchvision|torchaudio|triton|pytorch-triton"
    r"|transformer-engine(-.+)?|apex|flash-attn(-.+)?)$"
)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def container_pins() -> list[str]:
    """``name==version`` for every installed distribution of the torch stack, sorted."""
    pins = {
        f"{_normalise(dist.metadata['Name'])}=={dist.version}"
        for dist in importlib.metadata.distributions()
        if dist.metadata["Name"] and _TORCH_STACK.match(_normalise(dist.metadata["Name"]))
    }
    return sorted(pins)


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    out, extra = Path(argv[0]), argv[1:]
    bad = [pin for pin in extra if "==" not in pin]
    if bad:
        print(f"not NAME==VERSION: {' '.join(bad)}", file=sys.stderr)
        return 2
    pins = container_pins()
    if not any(pin.startswith("torch==") for pin in pins):
        print("torch is not installed here: build FROM an NGC PyTorch image", file=sys.stderr)
        return 1
    lines = [
        "# Written by scripts/docker/pin_container_packages.py while building the image.",
        "# The base image's compiled torch stack (do not replace: its extensions were built",
        "# against exactly these), then the versions this image chose for its own dependencies.",
        *pins,
        *extra,
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{out}:", *pins, *extra, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
