#!/usr/bin/env bash
# pod.sh NAME [--shared-shm] -- CMD...: run CMD like a pod would, with its own /dev/shm (a private
# tmpfs in a private mount namespace), logging to $LOGS/NAME.log. Prints the PID.
set -euo pipefail
name=$1; shift
private=1
if [ "${1:-}" = "--shared-shm" ]; then private=0; shift; fi
[ "$1" = "--" ] && shift
LOGS=${LOGS:-/tmp/vo-qwen/logs}
mkdir -p "$LOGS"
E=${VLLM_OMNI_ENV:-$HOME/.cache/omnimodel/vllm-omni-0.30.0-bf75fd4ca1}
export OMNIMODEL_VLLM_OMNI_CPU=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=${OVERLAY:-$(cd "$(dirname "$0")" && pwd)/overlay} PATH="$E/bin:$PATH" \
  VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-INFO}
if [ "$private" = 1 ]; then
  setsid unshare --mount --propagation private -- sh -c 'mount -t tmpfs -o size=2g tmpfs /dev/shm && exec "$@"' sh "$@" \
    >"$LOGS/$name.log" 2>&1 </dev/null &
else
  setsid "$@" >"$LOGS/$name.log" 2>&1 </dev/null &
fi
echo $!
