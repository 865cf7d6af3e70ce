#!/usr/bin/env bash
# The GPU runs behind bench/results/*-h200.json, on one H200 lent by the device tool (its image has torch,
# transformers, numpy, aiohttp, httpx; the rest travels as wheels in dist/whl, see bench/README.md).
#   bash bench/h200.sh omni-ladder omni3   (issue 39: Qwen2.5-Omni 7B sizes as three stage processes at 1,4,16,64
#     concurrent streams, then Qwen3-Omni 30B-A3B sizes batched in one process at 1 and 16; OMNI_SIZE / OMNI3_SIZE=tiny,
#     OMNI_DEVICE=cpu, OMNI_LADDER, OMNI3_LADDER and OMNI_SKIP_WHEELS=1 rehearse it on a CPU at tiny size; OMNI_HF=0
#     skips the whole-model baseline; every level records each stage's busy fraction and batch, see bench/README.md)
#   bash bench/h200.sh omni text t2i      (vae: Qwen-Image's VAE with and without vae_2d; omni-parts / omni-timeline / t2i-parts / t2i-kernels: where a stream's / a Qwen-Image request's time goes; sdpa: what a new prompt length costs each attention kernel; each section builds its random-weight model into /dev/shm first)
# Results land in $OUT (the device tool's output folder), one JSON per section plus the processes' logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
if [ -z "${OMNI_SKIP_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site dist/whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/operator:$PWD/runtime:$PWD/e2e:/tmp/site PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export OMNIMODEL_BENCH_LOGS=/tmp/h200-logs
om() { "$PY" -m omnimodel_runtime "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,power.draw --format=csv
"$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
# The GPU's utilisation and memory twice a second into $1 (unix time, %, MiB), while a section runs: with each
# ladder level's started_unix and wall_s it tells whether a saturated level is GPU-bound. None without nvidia-smi.
sampler_pid=
gpu_sampler() {
  command -v nvidia-smi >/dev/null || return 0
  ( while :; do
      printf '%s,' "$(date +%s.%N)"
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits | head -1
      sleep 0.5
    done ) >"$1" 2>/dev/null &
  sampler_pid=$!
}
stop_gpu_sampler() { [ -z "$sampler_pid" ] || { kill "$sampler_pid" 2>/dev/null; wait "$sampler_pid" 2>/dev/null; sampler_pid=; }; }
trap stop_gpu_sampler EXIT
status=0
for section in "$@"; do
  started=$(date +%s)
  case $section in
    omni)
      [ -d /dev/shm/omni7b ] || { time om make-tiny --preset qwen2.5-omni --size qwen2.5-omni-7b --device cuda --out /dev/shm/omni7b || exit 1; }
      om bench --preset qwen2.5-omni --model file:///dev/shm/omni7b --mode omni --max-tokens 48 --rounds 1 \
        --omni-prompts 2 --omni-concurrency 1,4 --omni-requests 4 --hf-baseline 3 --start-timeout 600 \
        --omni-deployments "${OMNI_DEPLOYMENTS:-in_process,three_processes}" \
        --out "$OUT/omni-qwen2.5-omni-7b-h200.json" >/dev/null || status=1
      ;;
    omni-ladder)
      # Continuous batching at scale: every stage its own process (gateway in front), 64 decode slots of
      # 2048 positions in the thinker and talker (enough for the bench's ~100-token prompts plus 48 text
      # tokens and 575 codes; 4096/8192 x 64 slots would not leave room for three processes), code2wav DiT
      # passes of up to 16 streams. HF's whole model runs afterwards in its own process (3 requests).
      size=${OMNI_SIZE:-qwen2.5-omni-7b}; model=/dev/shm/omni-$size
      [ -d "$model" ] || { time om make-tiny --preset qwen2.5-omni --size "$size" --device "${OMNI_DEVICE:-cuda}" --out "$model" || exit 1; }
      gpu_sampler "$OUT/omni-ladder-gpu-util.csv"
      om bench --preset qwen2.5-omni --model "file://$model" --mode omni --max-tokens 48 --rounds 1 \
        --omni-prompts 2 --omni-concurrency "${OMNI_LADDER:-1,4,16,64}" --omni-requests "${OMNI_REQUESTS:-16}" \
        --omni-deployments three_processes --hf-baseline "${OMNI_HF:-3}" --start-timeout 900 \
        --engine-arg max_batch_size=64 --engine-arg slot_capacity=2048 --engine-arg dit_batch=16 \
        ${OMNI_ENGINE_ARGS:-} --out "$OUT/omni-ladder-$size-${GPU_NAME:-h100}.json" >/dev/null || status=1
      stop_gpu_sampler
      ;;
    omni3)
      # Qwen3-Omni 30B-A3B sizes (~70 GB of bf16 weights) in one process on one GPU, MoE through grouped
      # products (engine_args.moe's default on CUDA). Batched as omni-ladder's Qwen2.5 stages: the thinker
      # and talker decode every stream in one step over 16 slots of 2048 positions (the bench's prompts plus
      # 48 text tokens and its codes; 3.2 GB of thinker cache), CUDA graphs per (rows, length) bucket, and
      # code2wav voices up to 16 streams' chunks in one pass;
      # batching=true is the default on CUDA, named so that a CPU rehearsal takes the same path. The 7B build
      # leaves /dev/shm first: host memory holds one of them, not both beside three processes.
      size=${OMNI3_SIZE:-qwen3-omni-30b-a3b}; model=/dev/shm/omni3-$size
      [ "$size" = tiny ] || rm -rf /dev/shm/omni-qwen2.5-omni-7b /dev/shm/omni7b
      [ -d "$model" ] || { time om make-tiny --preset qwen3-omni --size "$size" --device "${OMNI_DEVICE:-cuda}" --out "$model" || exit 1; }
      gpu_sampler "$OUT/omni3-gpu-util.csv"
      om bench --preset qwen3-omni --model "file://$model" --mode omni --max-tokens 48 --rounds 1 \
        --omni-prompts 2 --omni-concurrency "${OMNI3_LADDER:-1,16}" --omni-requests "${OMNI3_REQUESTS:-4}" \
        --omni-deployments in_process --hf-baseline 0 --start-timeout 900 \
        --engine-arg batching=true --engine-arg max_batch_size=16 --engine-arg slot_capacity=2048 \
        ${OMNI_ENGINE_ARGS:-} --out "$OUT/omni3-$size-${GPU_NAME:-h100}.json" >/dev/null || status=1
      stop_gpu_sampler
      ;;
    omni-parts)
      [ -d /dev/shm/omni7b ] || { time om make-tiny --preset qwen2.5-omni --size qwen2.5-omni-7b --device cuda --out /dev/shm/omni7b || exit 1; }
      python3 bench/omni_parts.py --model /dev/shm/omni7b --out "$OUT/omni-parts-qwen2.5-omni-7b-h200.json" || status=1
      ;;
    omni-timeline)
      [ -d /dev/shm/omni7b ] || { time om make-tiny --preset qwen2.5-omni --size qwen2.5-omni-7b --device cuda --out /dev/shm/omni7b || exit 1; }
      # OMNI_TIMELINE_VARIANTS: name=flags pairs, e.g. "py5ms=--switch-interval,0.005 chunk4=--engine-arg,chunk_blocks=4"
      for variant in ${OMNI_TIMELINE_VARIANTS:-defaults=}; do
        name=${variant%%=*}; flags=${variant#*=}
        python3 bench/omni_timeline.py --model /dev/shm/omni7b ${flags//,/ } \
          --out "$OUT/omni-timeline-$name-h200.json" >/dev/null || status=1
      done
      ;;
    sdpa)
      python3 bench/sdpa_shapes.py --out "$OUT/sdpa-shapes-h200.json" >/dev/null || status=1
      ;;
    text)
      [ -d /dev/shm/q7b ] || { time om make-tiny --preset text --size qwen2.5-7b --device cuda --out /dev/shm/q7b || exit 1; }
      om bench --model file:///dev/shm/q7b --engine transformers --concurrency 8 --requests 32 --max-tokens 128 \
        --rounds 1 --start-timeout 600 --out "$OUT/text-transformers-qwen2.5-7b-h200.json" >/dev/null || status=1
      ;;
    t2i)
      [ -d /dev/shm/qwen-image ] || { time om make-tiny --preset text-to-image --size qwen-image --device cuda --out /dev/shm/qwen-image || exit 1; }
      python3 bench/t2i_speed.py --model /dev/shm/qwen-image --sizes "${T2I_SIZES:-512,1024}" --steps 20 --runs "${T2I_RUNS:-3}" \
        --variants "${T2I_VARIANTS:-eager,cfgbatch,regional,regional+cfgbatch}" \
        --out "$OUT/${T2I_OUT:-t2i-qwen-image-speed-h200.json}" || status=1
      ;;
    vae)
      # Qwen-Image's VAE alone (127 M parameters, no /dev/shm model): diffusers' 3D convolutions against vae_2d.
      python3 bench/vae_speed.py --sizes "${T2I_SIZES:-512,1024}" --runs 7 --out "$OUT/vae-qwen-image-h200.json" || status=1
      ;;
    t2i-parts)
      [ -d /dev/shm/qwen-image ] || { time om make-tiny --preset text-to-image --size qwen-image --device cuda --out /dev/shm/qwen-image || exit 1; }
      for size in ${T2I_PARTS_SIZES:-1024}; do
        python3 bench/t2i_parts.py --model /dev/shm/qwen-image --size "$size" --out "$OUT/t2i-qwen-image-parts-$size-h200.json" || status=1
      done
      ;;
    t2i-kernels)
      python3 bench/t2i_kernels.py --size "${T2I_KERNELS_SIZE:-1024}" ${T2I_KERNELS_VARIANTS:+--variants "$T2I_KERNELS_VARIANTS"} \
        ${T2I_KERNELS_SUSTAIN:+--sustain "$T2I_KERNELS_SUSTAIN"} \
        --out "$OUT/${T2I_KERNELS_OUT:-t2i-qwen-image-kernels-${T2I_KERNELS_SIZE:-1024}-h200.json}" || status=1
      ;;
    *) echo "unknown section $section"; exit 2 ;;
  esac
  echo "== $section took $(( $(date +%s) - started )) s"
done
tar -C /tmp -czf "$OUT/logs.tar.gz" h200-logs 2>/dev/null || true
for f in "$OUT"/*.json; do
  [ -f "$f" ] || continue
  "$PY" - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))["results"]
print("==", sys.argv[1], "errors:", d.get("errors"))
def walk(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items():
            walk(v, f"{path}.{k}" if path else k)
    elif any(t in path for t in ("ttfa_p50", "ttfa_max", "rtf_p50", "text_tok_s", "tokens_per_s", "latency_p50", "ratio", "pixel", "requests_per_s", "failures", "busiest_stage", "busy_fraction", "mean_batch", "busy_ms_per_step")):
        print(f"  {path} = {x}")
walk(d)
PY
done
exit $status
