#!/usr/bin/env bash
# up.sh [--shared-shm]: head (thinker + API) on 127.0.0.2, talker on 127.0.0.3, code2wav on 127.0.0.4.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:-/tmp/vo-qwen/model}
CFG=${CFG:-$HERE/qwen2_5_omni_cpu.yaml}
MP=${MP:-25000}
SHM=${1:-}
COMMON=(--omni --deploy-config "$CFG" --dtype float32 ${EXTRA:-})
mkdir -p /tmp/vo-qwen
"$HERE/pod.sh" head $SHM -- vllm serve "$MODEL" "${COMMON[@]}" --stage-id 0 \
  --omni-master-address 127.0.0.2 --omni-master-port "$MP" --host 127.0.0.2 --port 8000 >/tmp/vo-qwen/head.pid
"$HERE/pod.sh" talker $SHM -- vllm serve "$MODEL" "${COMMON[@]}" --headless --stage-id 1 \
  -oma 127.0.0.2 -omp "$MP" --omni-replica-address 127.0.0.3 >/tmp/vo-qwen/talker.pid
"$HERE/pod.sh" code2wav $SHM -- vllm serve "$MODEL" "${COMMON[@]}" --headless --stage-id 2 \
  -oma 127.0.0.2 -omp "$MP" --omni-replica-address 127.0.0.4 >/tmp/vo-qwen/code2wav.pid
cat /tmp/vo-qwen/*.pid
