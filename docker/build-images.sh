#!/usr/bin/env bash
# Build (and with PUSH=1 push) the operator and runtime images, named as the chart and the operator name
# them: <REGISTRY>/omnimodel-operator:<version> and <REGISTRY>/omnimodel-runtime:<version>-<variant>
# (variants from the operator's own table, omnimodel_operator.settings.DEFAULT_RUNTIME_IMAGES).
#
#   docker/build-images.sh                      # the operator and the CPU runtime (what builds anywhere)
#   docker/build-images.sh operator cpu cuda    # these (cuda and rocm need their vendors' base images)
#   REGISTRY=registry.example.com/ml PUSH=1 docker/build-images.sh
#
# Engine: CONTAINER_ENGINE, else docker when a daemon answers, else buildah (no daemon: chroot isolation,
# the layers cached in its storage, so a source change rebuilds in about a minute). Both build the same
# Dockerfiles, in OCI format with buildah.
#
# Base: the official python:3.11-slim-bookworm (the Dockerfiles' PYTHON_IMAGE default) when it can be
# pulled; else, with buildah, one made from Debian's packages (docker/base/debian-python.sh). The build
# says which. PYTHON_IMAGE=... forces one.
#
# Where only PyPI is reachable, the CPU torch comes from a local wheel directory (OMNIMODEL_WHEELS or
# ../shared/wheels), mounted read-only into the build; the host's CA bundle likewise when pip on this
# machine names one (PIP_CERT). Neither lands in an image.
#
# Environment: REGISTRY (ghcr.io/omnimodel), PUSH, CONTAINER_ENGINE, PYTHON_IMAGE, PY (.venv/bin/python),
# DRY_RUN=1 (print the commands), IMAGES_OUT (a file that gets one built image name a line).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
REGISTRY=${REGISTRY:-ghcr.io/omnimodel}
REGISTRY=${REGISTRY%/}
OFFICIAL_PYTHON=python:3.11.14-slim-bookworm

log() { printf '[images] %s\n' "$*" >&2; }
run() {
  if [ -n "${DRY_RUN:-}" ]; then echo "$*"; else "$@"; fi
}

if [ -n "${CONTAINER_ENGINE:-}" ]; then
  engine=$CONTAINER_ENGINE
elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  engine=docker
elif command -v buildah >/dev/null 2>&1; then
  engine=buildah
else
  log "no container engine: install docker, or buildah (apt-get install buildah skopeo umoci)"
  exit 1
fi

selected=("$@")
[ "${#selected[@]}" -gt 0 ] || selected=(operator cpu)

build_args=()
mounts=()
if [ "$engine" = buildah ]; then
  # Which base: the official image if this machine can pull it, else the Debian-made one.
  base=${PYTHON_IMAGE:-}
  if [ -z "$base" ] && [ -n "${DRY_RUN:-}" ]; then
    base=docker.io/library/$OFFICIAL_PYTHON
  elif [ -z "$base" ]; then
    if timeout 60 buildah pull --quiet "docker.io/library/$OFFICIAL_PYTHON" >/dev/null 2>&1; then
      base=docker.io/library/$OFFICIAL_PYTHON
    else
      log "docker.io/library/$OFFICIAL_PYTHON cannot be pulled here: a base from Debian's packages instead"
      base=$(docker/base/debian-python.sh localhost/omnimodel-python-base:3.11-bookworm)
    fi
  fi
  log "base: $base"
  build_args+=(--build-arg "PYTHON_IMAGE=$base")
  wheels=""
  for d in "${OMNIMODEL_WHEELS:-}" ../shared/wheels /work/shared/wheels; do
    if [ -n "$d" ] && compgen -G "$d/torch-*.whl" >/dev/null; then wheels=$(cd "$d" && pwd); break; fi
  done
  if [ -n "$wheels" ]; then
    mounts+=(-v "$wheels:/run/omnimodel-wheels:ro")
    build_args+=(--build-arg PIP_FIND_LINKS=/run/omnimodel-wheels --build-arg PIP_EXTRA_INDEX_URL=)
    log "torch from $wheels"
  fi
  cert=${PIP_CERT:-$("$PY" -m pip config get global.cert 2>/dev/null || true)}
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    mounts+=(-v "$cert:/run/omnimodel-ca.pem:ro")
    build_args+=(--build-arg PIP_CERT=/run/omnimodel-ca.pem)
  fi
  engine_build=(buildah build --isolation chroot --layers --format oci "${mounts[@]}")
else
  [ -n "${PYTHON_IMAGE:-}" ] && build_args+=(--build-arg "PYTHON_IMAGE=$PYTHON_IMAGE")
  engine_build=("$engine" build)
fi

version=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
built=()
build() {  # build DOCKERFILE IMAGE
  local start=$SECONDS
  log "building $2 from $1 ($engine)"
  run "${engine_build[@]}" "${build_args[@]}" -f "$1" -t "$2" .
  log "built $2 in $((SECONDS - start)) s"
  built+=("$2")
  if [ -n "${PUSH:-}" ]; then
    run "$engine" push "$2"
  fi
}

# "<variant> <vendor>" per accelerator vendor, from the operator's table.
variants=$("$PY" -c '
from omnimodel_operator.accelerators import ACCELERATORS
for vendor, spec in ACCELERATORS.items():
    print(spec.image_variant, vendor.value)
')
for want in "${selected[@]}"; do
  if [ "$want" = operator ]; then
    build docker/operator.Dockerfile "$REGISTRY/omnimodel-operator:$version"
    continue
  fi
  if ! grep -qx "$want .*" <<< "$variants"; then
    log "unknown image '$want': operator, or a runtime variant ($(cut -d' ' -f1 <<< "$variants" | tr '\n' ' '))"
    exit 2
  fi
  dockerfile=docker/runtime.$want.Dockerfile
  if [ ! -f "$dockerfile" ]; then
    log "no $dockerfile: the operator refuses its vendor unless runtime.images (chart) or spec.runtime.image names one"
    exit 2
  fi
  build "$dockerfile" "$REGISTRY/omnimodel-runtime:$version-$want"
done

if [ -n "${IMAGES_OUT:-}" ]; then
  printf '%s\n' "${built[@]}" > "$IMAGES_OUT"
fi
