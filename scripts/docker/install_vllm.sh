#!/usr/bin/env bash
# Build vLLM from source against the torch already installed in the image.
#
#   install_vllm.sh VERSION          VERSION is a vLLM release, built from its git tag vVERSION
#
# vLLM's wheels on PyPI pin one exact PyPI torch (vllm 0.25.0: torch==2.11.0). The NGC image's
# torch is NVIDIA's own build (2.12.0a0+... in 26.05), which never satisfies that pin, so
# `pip install vllm` either fails against the image's constraints or replaces torch and breaks
# Transformer Engine and apex, which were compiled against it. vLLM documents a source build for
# "an existing PyTorch installation": use_existing_torch.py drops its torch requirements and the
# extension compiles against the installed torch.
#
# Environment: TORCH_CUDA_ARCH_LIST (GPU architectures to compile for: 9.0 = H100/H200),
# MAX_JOBS (parallel compile jobs; each nvcc job can take several GB of memory).
set -euo pipefail

version=${1:?usage: install_vllm.sh VERSION (a vLLM release such as 0.25.0)}
torch_before=$(python -c 'import torch; print(torch.__version__)')

src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git clone --quiet --depth 1 --branch "v${version}" https://github.com/vllm-project/vllm.git "$src"
cd "$src"
python use_existing_torch.py
# The build requirements moved from requirements/build.txt to requirements/build/cuda.txt.
if [[ -f requirements/build/cuda.txt ]]; then
  build_requirements=requirements/build/cuda.txt
else
  build_requirements=requirements/build.txt
fi
pip install --no-cache-dir -r "$build_requirements"
pip install --no-cache-dir --no-build-isolation .

torch_after=$(python -c 'import torch; print(torch.__version__)')
if [[ "$torch_after" != "$torch_before" ]]; then
  echo "installing vLLM replaced torch $torch_before with $torch_after" >&2
  exit 1
fi
echo "vllm $(python -c 'import importlib.metadata as m; print(m.version("vllm"))') built against torch $torch_after"
