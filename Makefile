# OmniModel — `make help` lists the targets.
SHELL := /bin/bash
PY ?= .venv/bin/python
VENV_BIN := $(dir $(PY))
# Kept in front of what the caller set (a worktree points PYTHONPATH at its own packages; replacing it
# would import the editable install's checkout instead).
export PYTHONPATH := e2e$(if $(PYTHONPATH),:$(PYTHONPATH),)
PYTEST_ARGS ?=

.DEFAULT_GOAL := help

.PHONY: help
help: ## List targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | sort | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2}'

.PHONY: venv
venv: ## Create .venv with every extra (CPU torch from ../shared/wheels when present)
	./.ci/setup-venv

# One lock for .venv, CI and the images (.ci/lock says how and why); LOCK_ARGS=--upgrade moves every pin.
.PHONY: lock lock-check
lock: ## Regenerate requirements.lock and docker/requirements/*.txt from pyproject.toml (needs PyPI)
	UV=$(VENV_BIN)uv ./.ci/lock $(LOCK_ARGS)

lock-check: ## Offline: fail when pyproject.toml, requirements.lock and docker/requirements/*.txt disagree
	$(PY) -m pytest -q tests/unit/test_lock.py $(PYTEST_ARGS)

.PHONY: crds
crds: ## Regenerate crds/ and the chart's CRD template from the pydantic API models
	$(VENV_BIN)omnimodel-operator crd > crds/omnimodel.io_omnimodels.yaml
	$(PY) charts/omnimodel-operator/hack/gen_crd.py

.PHONY: chart-generate chart-lint images
chart-generate: ## Regenerate the chart's CRD template and values.schema.json
	$(PY) charts/omnimodel-operator/hack/gen_crd.py
	$(PY) charts/omnimodel-operator/hack/gen_values_schema.py

chart-lint: cluster-build ## helm lint --strict the chart
	"$$($(PY) -m omnimodel_testbed helm-path)" lint --strict charts/omnimodel-operator

# IMAGES picks which (operator, cpu, cuda, rocm); cuda and rocm need their vendors' base images.
IMAGES ?= operator cpu
images: ## Build the operator and CPU runtime images (buildah, or docker) into the test bed's registry; REGISTRY=… PUSH=1 pushes there instead
	@./.ci/setup-image-tools
	@if [ -n "$(PUSH)" ]; then PY=$(PY) docker/build-images.sh $(IMAGES); else \
	  list=$$(mktemp) && trap 'rm -f "$$list"' EXIT && \
	  PY=$(PY) IMAGES_OUT="$$list" docker/build-images.sh $(IMAGES) && \
	  $(TESTBED) push-images $$(cat "$$list"); fi

.PHONY: lint
lint: ## ruff (lint + format check), mypy --strict, import-linter
	$(VENV_BIN)ruff check .
	$(VENV_BIN)ruff format --check .
	$(VENV_BIN)mypy operator/omnimodel_operator runtime/omnimodel_runtime $(wildcard e2e/omnimodel_testbed) bench
	$(VENV_BIN)lint-imports
	$(VENV_BIN)hadolint --failure-threshold style docker/*.Dockerfile
	./.ci/actionlint

.PHONY: fmt
fmt: ## Format and auto-fix
	$(VENV_BIN)ruff format .
	$(VENV_BIN)ruff check --fix .

.PHONY: unit
unit: cluster-build ## Unit and component tests (no cluster)
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The loop while editing: what is left once the tests marked slow (over 5 s run by themselves) are out;
# its ten slowest are printed, so a test that has grown past 5 s shows there.
# CI runs them all: test-suites and unit pass no -m.
.PHONY: quick
quick: cluster-build ## Unit and component tests not marked slow: the fast loop (docs/development.md)
	$(PY) -m pytest tests -m "not slow" --durations=10 $(PYTEST_ARGS)

.PHONY: e2e
e2e: cluster-build images ## End-to-end tests on the local control plane (reuses a running one; test_chart runs the operator image)
	$(PY) -m pytest e2e --ignore=e2e/serving --ignore=e2e/demo $(PYTEST_ARGS)

.PHONY: e2e-serving
# The cached environments are built out here: nothing inside the network namespace reaches PyPI.
e2e-serving: cluster-build images vllm-omni-env hfmirror-env ## Real requests through gateway and stage pods (own cluster, in a network namespace)
	$(PY) -m omnimodel_testbed netns -- $(PY) -m pytest e2e/serving $(PYTEST_ARGS)

.PHONY: bench-autoscaling
bench-autoscaling: cluster-build ## Replay bench/traces/burst.json autoscaled vs fixed replicas; JSON to bench/results/ (BENCH_ARGS=...)
	$(PY) -m omnimodel_testbed netns -- $(PY) e2e/bench_autoscaling.py $(BENCH_ARGS)

.PHONY: e2e-demo
e2e-demo: cluster-build images ## Run `make demo`'s script end to end and check its WAV, PNG and that nothing is left behind
	$(PY) -m pytest e2e/demo $(PYTEST_ARGS)

# The presets whose engines use transformers and diffusers directly, and the fuzz suite that starts each
# preset's server: run again against the newest releases (.venv has the lowest the project allows).
NEWEST_TESTS := tests/component/runtime/test_omni_pipeline.py tests/component/runtime/test_omni_speech.py \
	tests/component/runtime/test_omni_forced_reply.py tests/component/runtime/test_tts_engines.py \
	tests/component/runtime/test_t2i_engine.py tests/component/runtime/test_t2i_flux.py \
	tests/component/runtime/test_runtime_transformers_engine.py tests/component/runtime/test_fuzz_openapi.py

.PHONY: test-newest
test-newest: ## The omni, TTS, text-to-image and text engines' tests on the newest transformers and diffusers
	@py="$$(BASE_PY=$(PY) ./.ci/newest-venv)" && "$$py" -m pytest -m "not vllm and not vllm_omni" $(NEWEST_TESTS) $(PYTEST_ARGS)

.PHONY: test
test: lint cluster-build chart-lint images vllm-omni-env hfmirror-env ## Everything CI runs: lint, unit, component and e2e tests
	$(MAKE) --no-print-directory -j2 test-suites test-pods
	$(MAKE) --no-print-directory vllm-omni-catalogue-check

# test's two lanes, run side by side: each is long (about 25 min on 2 cores) and much of either is waiting
# on processes, so together they take far less than one after the other. They share nothing but the
# caches, which lock (tiny models) or are only read (images, environments); each has its own cluster.
# Each line is printed as it comes, prefixed with its lane (make's --output-sync would hold a lane's
# output until its command ends: half an hour of silence).
LANE = set -o pipefail; PYTHONUNBUFFERED=1
.PHONY: test-suites test-pods
test-suites: ## Lane 1 of test: unit, component and e2e tests on the local control plane
	@$(LANE) $(PY) -m pytest tests e2e --ignore=e2e/serving --ignore=e2e/demo $(PYTEST_ARGS) 2>&1 | sed -u 's/^/[suites] /'

test-pods: ## Lane 2 of test: the engines on the newest libraries, pods from their images, the demo
	@$(LANE) $(MAKE) --no-print-directory test-newest 2>&1 | sed -u 's/^/[pods] /'
	@$(LANE) $(MAKE) --no-print-directory e2e-serving 2>&1 | sed -u 's/^/[pods] /'
	@$(LANE) $(MAKE) --no-print-directory e2e-demo 2>&1 | sed -u 's/^/[pods] /'

.PHONY: hfmirror-env
hfmirror-env: ## Build (or reuse) the cached environment of the test bed's Hugging Face mirror (olah); prints its path
	e2e/hfmirror/setup-env

.PHONY: vllm-omni-env
vllm-omni-env: ## Build (or reuse) the cached vLLM-Omni CPU environment outside the repo; prints its path
	e2e/vllm-omni/setup-env

VLLM_OMNI_CATALOGUE := operator/omnimodel_operator/vllm_omni/catalogue.json

.PHONY: vllm-omni-catalogue vllm-omni-catalogue-check
vllm-omni-catalogue: ## Regenerate the operator's vLLM-Omni deploy-config catalogue from vLLM-Omni's own code
	"$$(e2e/vllm-omni/setup-env)/bin/python" e2e/vllm-omni/gen_catalogue.py $(VLLM_OMNI_CATALOGUE)

vllm-omni-catalogue-check: ## Fail when the committed vLLM-Omni catalogue differs from what the pinned vLLM-Omni generates
	@env_dir="$$(e2e/vllm-omni/setup-env)" && tmp="$$(mktemp)" && trap 'rm -f "$$tmp"' EXIT && \
	"$$env_dir/bin/python" e2e/vllm-omni/gen_catalogue.py "$$tmp" && \
	diff -u $(VLLM_OMNI_CATALOGUE) "$$tmp" && echo "vllm-omni catalogue: up to date"

.PHONY: render
render: ## Render every example to stdout, as the operator would apply it
	@for f in examples/*.yaml; do echo "# --- $$f"; $(VENV_BIN)omnimodel-operator render -f $$f; done

.PHONY: demo demo-serve
demo: images ## The operator deploys tiny OmniModels on the local cluster; chat, audio, image, scale (DEMO_KEEP=1 leaves it up)
	$(PY) -m omnimodel_testbed demo

demo-serve: ## The fast in-process demo: `omnimodel serve` on a tiny text model, asked once with the openai client
	$(VENV_BIN)omnimodel demo

-include e2e/cluster.mk
