# syntax=docker/dockerfile:1
#
# The CPU runtime image: <registry>/omnimodel-runtime:<version>-cpu, the operator's default for
# accelerator vendor `cpu` (omnimodel_operator.settings.DEFAULT_RUNTIME_IMAGES): VAE/vocoder stages on
# CPU pools, tiny-model demos, and every pod of the test bed's runtime.
#
#   make images                              # buildah here, docker where a daemon runs
#   docker build -f docker/runtime.cpu.Dockerfile -t omnimodel-runtime:0.1.0-cpu .
#
# torch is the CPU build (2.13.0+cpu, pinned in the lock), from the PyTorch CPU index: PyPI serves only
# the multi-GB CUDA build. A machine without that index passes a local wheel directory as PIP_FIND_LINKS
# and an empty PIP_EXTRA_INDEX_URL (`make images` does, from ../shared/wheels).
#
# Builds the same in docker and OCI format (no SHELL, no HEALTHCHECK). Shared memory: torch's
# shared-memory tensors outgrow a container's 64 MiB /dev/shm; the operator mounts an in-memory emptyDir
# there, with plain docker run use --shm-size=2g.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ----------------------------------------------------------------------------------------------- deps
# The locked dependencies alone (docker/requirements/runtime-cpu.txt, derived from requirements.lock):
# the 1.4 GB layer is rebuilt only when the lock changes, never for a source change.
FROM ${PYTHON_IMAGE} AS deps
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# pip reads these from the environment; unset unless the build passes them (a CA bundle, a local index).
ARG PIP_CERT
ARG PIP_FIND_LINKS
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY docker/requirements/runtime-cpu.txt /tmp/requirements.txt
RUN python -m venv /opt/omnimodel \
 && /opt/omnimodel/bin/pip install --no-cache-dir --no-deps --requirement /tmp/requirements.txt \
 && /opt/omnimodel/bin/pip check

# ---------------------------------------------------------------------------------------------- wheel
# The omnimodel wheel is pure Python: built apart, so no source tree or build tool reaches the image.
FROM ${PYTHON_IMAGE} AS wheel
ARG PIP_CERT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator/omnimodel_operator/ operator/omnimodel_operator/
COPY runtime/omnimodel_runtime/ runtime/omnimodel_runtime/
# A venv for pip: Debian's python3.11 (the base made without a registry) has no pip of its own.
RUN python -m venv /tmp/build \
 && /tmp/build/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -------------------------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="omnimodel-runtime" \
      org.opencontainers.image.description="OmniModel serving runtime (CPU)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.omnimodel.image.role="runtime" \
      io.omnimodel.image.variant="cpu"
RUN groupadd --gid 1000 omnimodel \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin omnimodel
COPY --from=deps /opt/omnimodel /opt/omnimodel
COPY --from=wheel /wheels/ /tmp/wheels/
# --no-deps: every dependency is in the layer above, at the lock's versions.
RUN /opt/omnimodel/bin/pip install --no-cache-dir --no-deps --no-index /tmp/wheels/omnimodel-*.whl \
 && rm -rf /tmp/wheels \
 && /opt/omnimodel/bin/omnimodel --help > /dev/null
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
# In Kubernetes the operator sets startup/readiness probes on /health and liveness on /livez per role.
ENTRYPOINT ["omnimodel"]
CMD ["--help"]
