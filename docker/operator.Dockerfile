# syntax=docker/dockerfile:1
#
# The operator image: ghcr.io/omnimodel/omnimodel-operator:<version> (the chart's image.repository).
# Only the `operator` extra: kopf, the Kubernetes client, pydantic-settings, prometheus-client. No torch,
# no FastAPI, no engines (import-linter keeps omnimodel_operator off them; tests/unit/chart checks this file).
#
#   docker build -f docker/operator.Dockerfile -t ghcr.io/omnimodel/omnimodel-operator:0.1.0 .
#
# Runs as uid 1000 with a read-only root filesystem in the chart; nothing is written outside /tmp.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------------------------------------- build
FROM ${PYTHON_IMAGE} AS build
ARG OMNIMODEL_EXTRAS=operator
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# Only what the distribution is built from (the repository's .dockerignore keeps the rest out).
COPY pyproject.toml README.md ./
COPY operator/omnimodel_operator/ operator/omnimodel_operator/
COPY runtime/omnimodel_runtime/ runtime/omnimodel_runtime/
RUN python -m venv /opt/omnimodel \
 && /opt/omnimodel/bin/pip install --no-cache-dir ".[${OMNIMODEL_EXTRAS}]" \
 && /opt/omnimodel/bin/omnimodel-operator crd > /dev/null

# -------------------------------------------------------------------------------------------- runtime
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="omnimodel-operator" \
      org.opencontainers.image.description="OmniModel Kubernetes operator (kopf)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.omnimodel.image.role="operator"
RUN groupadd --gid 1000 omnimodel \
 && useradd --uid 1000 --gid 1000 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin omnimodel
COPY --from=build /opt/omnimodel /opt/omnimodel
ENV PATH=/opt/omnimodel/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache
USER 1000:1000
WORKDIR /tmp
# kopf's liveness endpoint (the chart's probes use it too), and Prometheus /metrics (OMNIMODEL_METRICS_PORT).
EXPOSE 8080 8081
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["omnimodel-operator", "run"]
CMD ["--liveness=http://0.0.0.0:8080/healthz"]
