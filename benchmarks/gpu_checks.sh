#!/usr/bin/env bash
# Every GPU check of issues 3 and 4 in ONE device call (about 6-8 minutes on an H200), for a
# session whose task is lent a GPU. Never run by CI; on a CPU it runs the tiny shapes instead.
#
# Prepare here, once (the H200 box has torch, transformers, sentencepiece, PyYAML; not
# megatron-core, not wandb):
#   mkdir -p .gpu/whl && echo /.gpu/ >> .git/info/exclude
#   cp ../shared/bench/peer_step.py .gpu/
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#       -d .gpu/whl megatron-core==0.19.2
# Then one device `run` with carry [".gpu"] and timeout_s 580:
#   bash benchmarks/gpu_checks.sh
# Results land in $OUT (logs, JSON); the last lines printed are the summary table. Commit the
# numbers to benchmarks/results/ with the date, the hardware and the commit.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if compgen -G ".gpu/whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
PEER=()
[[ -f .gpu/peer_step.py ]] && PEER=(--peer .gpu/peer_step.py)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  | tee "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee "$OUT/commit.txt"

step() {  # name, seconds, command...: run one check, keep its log, never stop the others
  local name=$1 limit=$2
  shift 2
  echo "=== $name"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "$name rc=$rc" >>"$OUT/status.txt"
}

# 1. fused vocab-parallel log-probs vs naive torch vs megatron's cross entropy (issue 3:
#    forward <= 1.5 x 9.75 ms, forward+backward <= 1.5 x 29.3 ms, <= 1 GiB beyond the inputs)
step logprobs 120 python3 benchmarks/logprobs.py
# 2. one student training step, megatron-core + SDPA vs transformers + SDPA (issue 3: >= 1.10x),
#    and the teacher's scoring forward vs the HF forward peer
step train_step 180 python3 benchmarks/train_step.py "${PEER[@]}" --out "$OUT/train_step.json"
# 3. built-in rollouts vs transformers generate() at batch 64 (issue 4: >= 5x its tokens/s)
step rollout 150 python3 benchmarks/rollout.py "${PEER[@]}" --out "$OUT/rollout.json"
# 4. the trainer end to end on the GPU: NCCL with the gloo CPU half (cpu:gloo,cuda:nccl),
#    bf16, three steps, a checkpoint, on the embedded tiny config
step train 120 python3 -m megatron_gndpo.cli train -c examples/tiny_cpu.yaml \
  model.params_dtype=bf16 teacher.model.params_dtype=bf16 trainer.steps=3 \
  logging.run_dir="$OUT/run" checkpoint.save=/tmp/gpu_checks_ckpt

echo "=== summary ($(cat "$OUT/gpu.txt" 2>/dev/null), commit $(cat "$OUT/commit.txt" 2>/dev/null))"
cat "$OUT/status.txt"
for name in logprobs train_step rollout; do
  echo "--- $name"
  grep -v -i -E "warn|deprecat|^ *(return|class|if) " "$OUT/$name.log" | tail -n 8
done
echo "--- train"
grep -h -E "^step " "$OUT/train.log" | tail -n 3
