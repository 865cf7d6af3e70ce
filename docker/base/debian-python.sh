#!/usr/bin/env bash
# Build the Python base image from Debian's packages, for machines that cannot pull the official
# python:3.11-slim-bookworm image (no registry reachable, only a Debian mirror). It is what the
# Dockerfiles' PYTHON_IMAGE build arg names instead; `make images` says which base it used.
#
#   docker/base/debian-python.sh IMAGE_NAME     # prints the image name when it exists in buildah's storage
#
# debootstrap's minbase variant plus python3.11 and its venv module (Debian's 3.11.2, not the slim
# image's 3.11.14), then what a container image needs none of: apt's caches, docs, man pages and
# locales. /dev stays empty (the runtime mounts its own). The tarball is cached under
# ${OMNIMODEL_CACHE:-~/.cache/omnimodel}/images, keyed by this script's content, so a machine builds it
# once (about 4 minutes) and re-imports it in seconds.
set -euo pipefail

name=${1:?usage: debian-python.sh IMAGE_NAME}
suite=bookworm
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
packages=python3.11,python3.11-venv,python3-venv,ca-certificates,passwd

log() { printf '[debian-base] %s\n' "$*" >&2; }

if buildah inspect --type image "$name" >/dev/null 2>&1; then
  echo "$name"
  exit 0
fi

cache="${OMNIMODEL_CACHE:-$HOME/.cache/omnimodel}/images"
key=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)
tarball="$cache/debian-python-$suite-$key.tar"
mkdir -p "$cache"
if [ ! -s "$tarball" ]; then
  root=$(mktemp -d)
  trap 'rm -rf "$root"' EXIT
  log "debootstrap $suite ($packages) from $mirror"
  start=$SECONDS
  debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >&2
  rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/log/*
  find "$root"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
  ln -sf python3.11 "$root/usr/bin/python"
  ln -sf python3.11 "$root/usr/bin/python3"
  # Device nodes are the runtime's to provide; a tarball carrying them would need mknod to unpack.
  tar -C "$root" --exclude='./dev/*' --numeric-owner -cf "$tarball.tmp" .
  mv -f "$tarball.tmp" "$tarball"
  log "built $tarball in $((SECONDS - start)) s"
fi
container=$(buildah from scratch)
buildah add --quiet "$container" "$tarball" / >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
  --cmd python3 --label io.omnimodel.base="debian-$suite-$key" "$container"
buildah commit --quiet --rm "$container" "$name" >/dev/null
log "imported $name"
echo "$name"
