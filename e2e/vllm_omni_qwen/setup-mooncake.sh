#!/usr/bin/env bash
# setup-mooncake.sh: the Mooncake client + master for the network-connector test (CPU build from PyPI),
# installed beside (not into) the vLLM-Omni environment; prints the directory to put on PYTHONPATH.
set -euo pipefail
E=${VLLM_OMNI_ENV:-$HOME/.cache/omnimodel/vllm-omni-0.30.0-bf75fd4ca1}
VERSION=0.3.13.post1
SITE=${MOONCAKE_SITE:-$HOME/.cache/omnimodel/mooncake-non-cuda-$VERSION}
if [ ! -f "$SITE/.ready" ]; then
  # Its native libraries link libibverbs even when the protocol is TCP.
  if ! ldconfig -p | grep -q libibverbs.so.1; then
    apt-get install -y -qq libibverbs1 librdmacm1 >/dev/null
  fi
  "$E/bin/python" -m pip install -q --disable-pip-version-check --no-deps --target "$SITE" \
    "mooncake-transfer-engine-non-cuda==$VERSION" >&2
  PYTHONPATH=$SITE "$E/bin/python" -c "from mooncake.store import MooncakeDistributedStore" >&2
  touch "$SITE/.ready"
fi
echo "$SITE"
