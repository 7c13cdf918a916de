#!/usr/bin/env bash
# The Megatron-Bridge tier on a CPU machine: a virtual environment with Megatron-Bridge 0.6.2 and
# the megatron-core and transformers it pins, for the round trips of tests/test_bridge.py (its
# side runs docs/interop/bridge_side.py in this environment; ours runs in the main .venv).
#
#   scripts/ci/install_bridge_cpu.sh VENV_DIR          e.g. .venv-bridge (about 1 min, 0.5 GB)
#   .venv/bin/pytest -m bridge                          the round trips (MEGATRON_GNDPO_BRIDGE_VENV
#                                                       names VENV_DIR if not .venv-bridge)
#
# Its own environment: Bridge pins transformers<=5.12.1, the main one has a newer one. Torch is
# not installed: it is borrowed from this checkout's main venv (.venv beside scripts/, which
# must exist) through a .pth at the end of sys.path, so the packages installed here come first
# (transformers 5.12.1 shadows the main venv's). PyPI's torch is the CUDA build (GBs) and the
# CPU index may be unreachable; both tiers then run the same torch. PYTHON: the interpreter to
# build the environment with (default: the main venv's base Python 3.12).
set -euo pipefail

venv=${1:?usage: install_bridge_cpu.sh VENV_DIR}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
main_venv=$root/.venv
bridge_version=0.6.2
mcore_version=0.19.2

if [[ ! -x $main_venv/bin/python ]]; then
  echo "install_bridge_cpu.sh: needs the main venv at $main_venv (its torch is borrowed)" >&2
  exit 2
fi
main_site=$("$main_venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python=${PYTHON:-$("$main_venv/bin/python" -c 'import sys; print(sys._base_executable)')}
if ! "$python" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "install_bridge_cpu.sh: needs Python 3.12, as the main venv (set PYTHON=/path/to/python3.12)" >&2
  exit 2
fi

start=$(date +%s)
"$python" -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$main_site" > "$site/zz_main_venv_torch.pth"
pip=("$venv/bin/python" -m pip install --quiet)
# 1. Bridge and megatron-core without their dependencies (they would pull a CUDA torch and
#    Transformer Engine); 2. what Bridge's AutoBridge path imports, transformers at its pin;
#    3. what megatron.bridge.training (save_megatron_model) imports.
# kernels at transformers 5.12.1's own pin (its `kernels` extra): the main venv's transformers
# depends on a newer kernels that the .pth would otherwise lend, whose LayerRepository refuses
# the arguments transformers 5.12.1 passes at import ("Either a revision or a version must be
# specified"; CI failed on it on 2026-12-03).
"${pip[@]}" --no-deps "megatron-core==$mcore_version" "megatron-bridge==$bridge_version"
"${pip[@]}" "transformers==5.12.1" "kernels>=0.12,<0.13" einops omegaconf "hydra-core>=1.3.4,<1.4" \
  pyyaml tqdm rich safetensors numpy packaging
"${pip[@]}" datasets megatron-energon

"$venv/bin/python" - "$bridge_version" "$main_site" <<'PY'
import importlib.metadata as metadata
import sys

import kernels
import torch
import transformers

want, main_site = sys.argv[1:]
got = metadata.version("megatron-bridge")
assert got == want, f"megatron-bridge {got} installed, expected {want}"
assert torch.__file__.startswith(main_site), f"torch from {torch.__file__}, not the main venv"
assert transformers.__version__ == "5.12.1", f"transformers {transformers.__version__} moved"
assert not kernels.__file__.startswith(main_site), "kernels from the main venv, not the pin here"
print(f"Bridge tier ready: megatron-bridge {got}, transformers {transformers.__version__}, "
      f"torch {torch.__version__} (the main venv's)")
PY
echo "install_bridge_cpu.sh: $venv built in $(( $(date +%s) - start )) s"
