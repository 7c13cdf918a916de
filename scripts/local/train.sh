#!/usr/bin/env bash
# Train on this machine: torchrun --standalone (as `megatron-gndpo launch`) with one process per
# visible GPU, or one process on the CPU when there is no GPU.
#
#   scripts/local/train.sh                                   # the embedded tiny CPU config
#   scripts/local/train.sh -c examples/qwen2.5-1.5b_from_7b.yaml trainer.steps=10
#   NPROC=2 scripts/local/train.sh -c examples/tiny_cpu.yaml # two gloo processes on a CPU
#   DRY_RUN=1 scripts/local/train.sh ...                     # print the command, run nothing
#
# Arguments are those of `megatron-gndpo train`. Environment:
#   NPROC    processes (default: the GPUs CUDA_VISIBLE_DEVICES names, else those nvidia-smi lists,
#            else 1 on the CPU)
#   PYTHON   interpreter that has the package installed (default python3; e.g. .venv/bin/python).
#            The launcher is `$PYTHON -m megatron_gndpo.cli launch` (torchrun, ending with one
#            line that names a failed process), so launcher and workers come from that
#            interpreter.
#   DRY_RUN  1: print the command instead of running it
set -euo pipefail

visible_gpus() {
  # CUDA_VISIBLE_DEVICES, when set, decides what torch sees; nvidia-smi ignores it.
  if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
    local ids=${CUDA_VISIBLE_DEVICES//[[:space:]]/}
    if [[ -z $ids || $ids == -1 ]]; then
      echo 0
    else
      local -a list
      IFS=, read -ra list <<<"$ids"
      echo "${#list[@]}"
    fi
  elif command -v nvidia-smi >/dev/null 2>&1; then
    # GPU lines only (MIG devices are listed under their GPU); 0 when the driver does not answer.
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  else
    echo 0
  fi
}

PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-$(visible_gpus)}
if ((NPROC < 1)); then
  echo "train.sh: no GPU visible: one process on the CPU (gloo)" >&2
  NPROC=1
fi

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export PYTHONUNBUFFERED=1

cmd=("$PYTHON" -m megatron_gndpo.cli launch --standalone --nnodes 1 --nproc-per-node "$NPROC"
  train "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
exec "${cmd[@]}"
