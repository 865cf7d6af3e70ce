# syntax=docker/dockerfile:1
#
# The operator image: <registry>/omnimodel-operator:<version> (the chart's image.repository and tag).
# Only the `operator` extra: kopf, the Kubernetes client, pydantic-settings, prometheus-client. No torch,
# no FastAPI, no engines (import-linter keeps omnimodel_operator off them; tests/component/chart checks this file).
#
#   make images                              # buildah here, docker where a daemon runs
#   docker build -f docker/operator.Dockerfile -t omnimodel-operator:0.1.0 .
#
# Builds the same in docker and OCI format (no SHELL, no HEALTHCHECK: the chart's probes check
# /healthz). Runs as uid 1000 with a read-only root filesystem in the chart; nothing is written outside
# /tmp.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ----------------------------------------------------------------------------------------------- deps
# The locked dependencies alone (docker/requirements/operator.txt, derived from requirements.lock): this
# layer is rebuilt only when the lock changes, never for a source change.
FROM ${PYTHON_IMAGE} AS deps
# pip reads these from the environment; unset unless the build passes them (a CA bundle, a local index).
ARG PIP_CERT
ARG PIP_FIND_LINKS
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
COPY docker/requirements/operator.txt /tmp/requirements.txt
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
LABEL org.opencontainers.image.title="omnimodel-operator" \
      org.opencontainers.image.description="OmniModel Kubernetes operator (kopf)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.omnimodel.image.role="operator"
RUN groupadd --gid 1000 omnimodel \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin omnimodel
COPY --from=deps /opt/omnimodel /opt/omnimodel
COPY --from=wheel /wheels/ /tmp/wheels/
# --no-deps: every dependency is in the layer above, at the lock's versions; `crd` imports the whole
# operator, so a wheel that misses a module fails the build here rather than in a cluster.
RUN /opt/omnimodel/bin/pip install --no-cache-dir --no-deps --no-index /tmp/wheels/omnimodel-*.whl \
 && rm -rf /tmp/wheels \
 && /opt/omnimodel/bin/omnimodel-operator crd > /dev/null
ENV PATH=/opt/omnimodel/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache
USER 1000:1000
WORKDIR /tmp
# kopf's liveness endpoint (the chart's probes use it), and Prometheus /metrics (OMNIMODEL_METRICS_PORT).
EXPOSE 8080 8081
ENTRYPOINT ["omnimodel-operator", "run"]
CMD ["--liveness=http://0.0.0.0:8080/healthz"]
