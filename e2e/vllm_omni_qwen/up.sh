#!/usr/bin/env bash
# up.sh [--shared-shm]: head (thinker + API) on 127.0.0.2, talker on 127.0.0.3, code2wav on 127.0.0.4.
# CONNECTOR=mooncake: both edges through MooncakeStoreConnector over TCP, with a mooncake_master "pod"
# on 127.0.0.5 and one deploy config per pod (its own advertised host).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:-/tmp/vo-qwen/model}
MP=${MP:-25000}
SHM=${1:-}
mkdir -p /tmp/vo-qwen/logs
cfg_for() {  # cfg_for POD IP: the deploy config that pod reads
  if [ "${CONNECTOR:-shm}" = mooncake ]; then
    sed "s/@HOST@/$2/" "${CFG_IN:-$HERE/qwen2_5_omni_cpu_mooncake.yaml.in}" >"/tmp/vo-qwen/cfg-$1.yaml"
    echo "/tmp/vo-qwen/cfg-$1.yaml"
  else
    echo "${CFG:-$HERE/qwen2_5_omni_cpu.yaml}"
  fi
}
if [ "${CONNECTOR:-shm}" = mooncake ]; then
  MC=$("$HERE/setup-mooncake.sh")
  export OVERLAY="${OVERLAY:-$HERE/overlay}:$MC"
  "$HERE/pod.sh" mooncake-master $SHM -- "$MC/mooncake/mooncake_master" -rpc_address 127.0.0.5 -rpc_port 50051 \
    -enable_http_metadata_server=true -http_metadata_server_host 127.0.0.5 -http_metadata_server_port 8080 \
    -metrics_host 127.0.0.5 -metrics_port 9003 >/tmp/vo-qwen/mooncake-master.pid
  sleep 2
fi
common() { echo --omni --deploy-config "$1" --dtype float32 ${EXTRA:-}; }
"$HERE/pod.sh" head $SHM -- vllm serve "$MODEL" $(common "$(cfg_for head 127.0.0.2)") --stage-id 0 \
  --omni-master-address 127.0.0.2 --omni-master-port "$MP" --host 127.0.0.2 --port 8000 >/tmp/vo-qwen/head.pid
"$HERE/pod.sh" talker $SHM -- vllm serve "$MODEL" $(common "$(cfg_for talker 127.0.0.3)") --headless --stage-id 1 \
  -oma 127.0.0.2 -omp "$MP" --omni-replica-address 127.0.0.3 >/tmp/vo-qwen/talker.pid
"$HERE/pod.sh" code2wav $SHM -- vllm serve "$MODEL" $(common "$(cfg_for code2wav 127.0.0.4)") --headless --stage-id 2 \
  -oma 127.0.0.2 -omp "$MP" --omni-replica-address 127.0.0.4 >/tmp/vo-qwen/code2wav.pid
cat /tmp/vo-qwen/*.pid
