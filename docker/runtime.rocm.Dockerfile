# syntax=docker/dockerfile:1
#
# The AMD runtime image: ghcr.io/omnimodel/omnimodel-runtime:<version>-rocm, the operator's default
# for accelerator vendor `amd` (omnimodel_operator.settings.DEFAULT_RUNTIME_IMAGES).
#
# Built on the official vLLM OpenAI ROCm image, which brings ROCm, torch and vLLM already matched to each
# other; we add our runtime with the transformers/diffusers/tts engines and never touch torch or vLLM
# (the base's versions are passed to pip as constraints).
#
#   docker build -f docker/runtime.rocm.Dockerfile -t ghcr.io/omnimodel/omnimodel-runtime:0.1.0-rocm .
#
# Shared memory: torch and RCCL need far more than a container's 64 MiB /dev/shm. The operator mounts
# an in-memory emptyDir there; with plain docker run use --ipc=host or --shm-size=8g.

ARG VLLM_IMAGE=vllm/vllm-openai-rocm:v0.33.0
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------------------------------------- wheel
# The omnimodel wheel is pure Python: build it apart so no source tree or build tool reaches the image.
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/omnimodel_operator/ operator/omnimodel_operator/
COPY runtime/omnimodel_runtime/ runtime/omnimodel_runtime/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -------------------------------------------------------------------------------------------- runtime
FROM ${VLLM_IMAGE}
ARG OMNIMODEL_EXTRAS=runtime,transformers,diffusers,tts
LABEL org.opencontainers.image.title="omnimodel-runtime" \
      org.opencontainers.image.description="OmniModel serving runtime (ROCm, vLLM)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.omnimodel.image.role="runtime" \
      io.omnimodel.image.variant="rocm"
COPY --from=wheel /wheels/ /tmp/wheels/
# The base installs into its system Python, hence PIP_BREAK_SYSTEM_PACKAGES; the constraints pin every
# GPU package of the base so that resolving our extras can never swap a ROCm build for another.
RUN python3 -m pip list --format=freeze > /tmp/base-packages.txt \
 && grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton-rocm|vllm|xformers|flashinfer-python|flash-attn)==' /tmp/base-packages.txt \
      > /tmp/base-constraints.txt \
 && grep -iq '^torch==' /tmp/base-constraints.txt \
 && grep -iq '^vllm==' /tmp/base-constraints.txt \
 && wheel=$(echo /tmp/wheels/omnimodel-*.whl) \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
      --constraint /tmp/base-constraints.txt "${wheel}[${OMNIMODEL_EXTRAS}]" \
 && rm -rf /tmp/wheels /tmp/base-packages.txt /tmp/base-constraints.txt \
 && omnimodel --help > /dev/null
# uid 1000 is what the operator's pods run as (runAsUser); reuse the base's user if it has one.
RUN if ! getent group 1000 > /dev/null; then groupadd --gid 1000 omnimodel; fi \
 && if ! getent passwd 1000 > /dev/null; then \
      useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin omnimodel; \
    fi
# Every cache under /tmp (an emptyDir in the pod) so the root filesystem can stay read-only; model
# weights go to HF_HOME, which the operator points at the model-cache volume.
ENV HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    NUMBA_CACHE_DIR=/tmp/.cache/numba \
    MPLCONFIGDIR=/tmp/.cache/matplotlib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 1000:1000
WORKDIR /tmp
EXPOSE 8000 8001
# No HEALTHCHECK: the port depends on the command (gateway 8000, stage 8001), and in Kubernetes the
# operator sets startup/readiness probes on /health and liveness on /livez per role.
ENTRYPOINT ["omnimodel"]
CMD ["--help"]
