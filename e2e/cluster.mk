# Local Kubernetes test bed (DESIGN.md section 6). Included by the top Makefile;
# also usable alone: `make -f e2e/cluster.mk cluster-up`. Paths are relative to
# the repository root, so run make from there.
#
# Binaries are built from e2e/cluster (Go) into ${OMNIMODEL_CACHE:-~/.cache/omnimodel},
# cluster state lives in ${OMNIMODEL_TESTBED_STATE_DIR:-<cache>/cluster}.

PY ?= .venv/bin/python
TESTBED ?= PYTHONPATH=e2e$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PY) -m omnimodel_testbed

.PHONY: cluster-build cluster-up cluster-down cluster-status kubeconfig helm-path

cluster-build: ## Build kube-apiserver/etcd/kwok/helm etc. into the cache (no-op when cached)
	@$(TESTBED) build

cluster-up: ## Start the local test-bed cluster with fake GPU nodes (idempotent)
	@$(TESTBED) up

cluster-down: ## Stop every process of the local test-bed cluster
	@$(TESTBED) down

cluster-status: ## Show the test-bed cluster state as JSON
	@$(TESTBED) status || true

kubeconfig: ## Print the test-bed admin kubeconfig path
	@$(TESTBED) kubeconfig

helm-path: ## Print the path of the helm binary built for the test bed
	@$(TESTBED) helm-path
