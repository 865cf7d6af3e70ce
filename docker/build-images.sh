#!/usr/bin/env bash
# Build (and with PUSH=1 push) the operator and runtime images under the names the chart and the
# operator use by default: the runtime tags come from the operator's own table
# (omnimodel_operator.settings.DEFAULT_RUNTIME_IMAGES), so an image built here is the image an
# OmniModel without spec.runtime.image gets. DRY_RUN=1 prints the commands instead.
#
#   docker/build-images.sh                 # every image that has a Dockerfile
#   docker/build-images.sh operator cpu    # only these (operator, or a runtime variant)
#
# Environment: CONTAINER_ENGINE (docker), PY (.venv/bin/python), OPERATOR_REPOSITORY, BUILD_ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${CONTAINER_ENGINE:-docker}
PY=${PY:-.venv/bin/python}
OPERATOR_REPOSITORY=${OPERATOR_REPOSITORY:-ghcr.io/omnimodel/omnimodel-operator}
read -r -a build_args <<< "${BUILD_ARGS:-}"

run() {
  if [ -n "${DRY_RUN:-}" ]; then echo "$*"; else "$@"; fi
}

build() {  # build DOCKERFILE IMAGE
  run "$ENGINE" build "${build_args[@]}" -f "$1" -t "$2" .
  if [ -n "${PUSH:-}" ]; then run "$ENGINE" push "$2"; fi
}

selected=("$@")
is_selected() {
  [ "${#selected[@]}" -eq 0 ] && return 0
  local s
  for s in "${selected[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}

version=$("$PY" -c 'import omnimodel_operator; print(omnimodel_operator.__version__)')
if is_selected operator; then
  build docker/operator.Dockerfile "$OPERATOR_REPOSITORY:$version"
fi

# "<variant> <image>" per accelerator vendor, from the operator's table.
images=$("$PY" -c '
from omnimodel_operator.accelerators import ACCELERATORS
from omnimodel_operator.settings import DEFAULT_RUNTIME_IMAGES
for vendor, spec in ACCELERATORS.items():
    print(spec.image_variant, DEFAULT_RUNTIME_IMAGES[vendor.value])
')
while read -r variant image; do
  is_selected "$variant" || continue
  dockerfile=docker/runtime.$variant.Dockerfile
  if [ -f "$dockerfile" ]; then
    build "$dockerfile" "$image"
  else
    echo "build-images: no $dockerfile yet, so no $image" >&2
  fi
done <<< "$images"
