#!/usr/bin/env bash
# Build the local-cluster binaries (kube-apiserver, kube-controller-manager,
# kube-scheduler, etcd, kwok, helm) from the pinned Go modules in this
# directory, into a cache OUTSIDE the repository:
#
#   ${OMNIMODEL_CACHE:-$HOME/.cache/omnimodel}/k8s-<kube>-etcd-<etcd>-kwok-<kwok>-helm-<helm>/
#     bin/<binary>            the executables
#     stages/*.yaml           kwok Stage documents copied from the kwok module
#
# Idempotent: a binary that already exists is not rebuilt (delete it, or the
# cache dir, to force a rebuild). Progress goes to stderr; the last line on
# stdout is the bin directory, so callers can do `BIN=$(e2e/cluster/build.sh)`.
#
# Versions are read from go.mod (the single source of truth), so bumping a pin
# there automatically changes the cache key.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"

log() { printf '[cluster-build] %s\n' "$*" >&2; }

# Versions straight from go.mod's require block via `go list -m`, which also
# accounts for MVS upgrades (the version actually compiled).
modver() { go list -m -f '{{.Version}}' "$1"; }
kube_version="$(modver k8s.io/kubernetes)"     # e.g. v1.36.5
etcd_version="$(modver go.etcd.io/etcd/server/v3)"
kwok_version="$(modver sigs.k8s.io/kwok)"
helm_version="$(modver helm.sh/helm/v3)"

kube_major="${kube_version#v}"; kube_major="${kube_major%%.*}"
kube_minor="${kube_version#v*.}"; kube_minor="${kube_minor%%.*}"

cache_root="${OMNIMODEL_CACHE:-$HOME/.cache/omnimodel}"
key="k8s-${kube_version}-etcd-${etcd_version}-kwok-${kwok_version}-helm-${helm_version}"
out="${cache_root}/${key}"
bin="${out}/bin"
stages="${out}/stages"
mkdir -p "$bin" "$stages"

export CGO_ENABLED=0
# -trimpath: reproducible, and keeps $HOME paths out of binaries.
# -buildvcs=false: this module lives inside the project's git work tree,
# whose VCS state is irrelevant to these binaries.
goflags=(-trimpath -buildvcs=false)

# Version stamping: without these the Kubernetes binaries report
# v0.0.0-master, which breaks tools that parse --version (kubectl skew
# warnings, kwok's version checks).
kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X ${pkg}.gitVersion=${kube_version}"
  kube_ldflags+=" -X ${pkg}.gitMajor=${kube_major}"
  kube_ldflags+=" -X ${pkg}.gitMinor=${kube_minor}"
  kube_ldflags+=" -X ${pkg}.gitTreeState=clean"
  kube_ldflags+=" -X ${pkg}.buildDate=1970-01-01T00:00:00Z"
done

kwok_ldflags="${kube_ldflags}"
kwok_ldflags+=" -X sigs.k8s.io/kwok/pkg/consts.Version=${kwok_version#v}"
kwok_ldflags+=" -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${kube_version#v}"

# helm defaults Capabilities.KubeVersion to v1.20 unless told otherwise; make
# `helm template`/`helm lint` assume the cluster version we actually run.
helm_ldflags="-s -w"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.version=${helm_version}"
helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
  helm_ldflags+=" -X ${pkg}.k8sVersionMajor=${kube_major}"
  helm_ldflags+=" -X ${pkg}.k8sVersionMinor=${kube_minor}"
done

# etcd prints GitSHA in --version; there is no commit here, so say where it came from.
etcd_ldflags="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-${etcd_version}"

build() { # name package ldflags
  local name="$1" pkg="$2" ldflags="$3"
  if [[ -x "${bin}/${name}" ]]; then
    log "${name}: cached"
    return 0
  fi
  log "${name}: building ${pkg}"
  local start=$SECONDS
  # Build into a temp name and rename, so an interrupted build never leaves a
  # half-written binary that the "cached" check would accept.
  go build "${goflags[@]}" -ldflags "${ldflags}" -o "${bin}/.${name}.tmp" "${pkg}"
  mv -f "${bin}/.${name}.tmp" "${bin}/${name}"
  log "${name}: built in $((SECONDS - start))s"
}

total_start=$SECONDS
build etcd go.etcd.io/etcd/server/v3 "${etcd_ldflags}"
build kwok sigs.k8s.io/kwok/cmd/kwok "${kwok_ldflags}"
build helm helm.sh/helm/v3/cmd/helm "${helm_ldflags}"
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler "${kube_ldflags}"
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "${kube_ldflags}"
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "${kube_ldflags}"

# The OCI registry images are pulled from (registry/README.md): its own module, its own cache key, so a
# registry bump rebuilds nothing else; the harness finds it beside the other binaries.
registry_version="$(cd registry && go list -m -f '{{.Version}}' github.com/distribution/distribution/v3)"
registry_bin="${cache_root}/registry-${registry_version}/bin"
mkdir -p "${registry_bin}"
if [[ -x "${registry_bin}/registry" ]]; then
  log "registry: cached"
else
  log "registry: building github.com/distribution/distribution/v3/cmd/registry ${registry_version}"
  start=$SECONDS
  (cd registry && go build "${goflags[@]}" \
    -ldflags "-s -w -X github.com/distribution/distribution/v3/version.version=${registry_version}" \
    -o "${registry_bin}/.registry.tmp" github.com/distribution/distribution/v3/cmd/registry)
  mv -f "${registry_bin}/.registry.tmp" "${registry_bin}/registry"
  log "registry: built in $((SECONDS - start))s"
fi
ln -sfn "${registry_bin}/registry" "${bin}/registry"

# kwok's standalone controller has no built-in stages; copy the ones the
# harness uses out of the module cache (read-only there, hence cat not cp -p).
kwok_dir="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
if [[ -z "${kwok_dir}" || ! -d "${kwok_dir}/kustomize/stage" ]]; then
  go mod download sigs.k8s.io/kwok
  kwok_dir="$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
fi
copy_stage() { # relative-path-in-module destination-name
  local src="${kwok_dir}/kustomize/stage/$1" dst="${stages}/$2"
  if [[ ! -s "${dst}" ]]; then
    cat "${src}" > "${dst}.tmp"
    mv -f "${dst}.tmp" "${dst}"
    log "stage: ${2} <- ${1}"
  fi
}
copy_stage node/fast/node-initialize.yaml node-initialize.yaml
copy_stage node/heartbeat-with-lease/node-heartbeat-with-lease.yaml node-heartbeat-with-lease.yaml
copy_stage pod/fast/pod-ready.yaml pod-ready.yaml
copy_stage pod/fast/pod-complete.yaml pod-complete.yaml
copy_stage pod/fast/pod-delete.yaml pod-delete.yaml
if [[ ! -s "${out}/LICENSE.kwok" ]]; then
  cat "${kwok_dir}/LICENSE" > "${out}/LICENSE.kwok"
fi

# Machine-readable record of what is in this cache dir (read by the harness).
cat > "${out}/versions.json.tmp" <<EOF
{"kubernetes": "${kube_version}", "etcd": "${etcd_version}", "kwok": "${kwok_version}", "helm": "${helm_version}"}
EOF
mv -f "${out}/versions.json.tmp" "${out}/versions.json"

log "done in $((SECONDS - total_start))s: ${bin}"
echo "${bin}"
