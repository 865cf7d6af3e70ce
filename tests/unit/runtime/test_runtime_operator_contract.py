"""Contract between what the operator renders and what the runtime accepts (STYLE habit 13).

Renders the operator's manifests for the text preset and checks, from the runtime side, that each
container's command line parses, each ``OMNIMODEL_*`` variable lands in ``RuntimeSettings``, the probe
paths exist on the apps, and the ConfigMap's pipeline file builds a gateway.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from omnimodel_operator.runtimes import render, resolve
from omnimodel_operator.settings import DEFAULT_RUNTIME_IMAGES, OperatorSettings
from omnimodel_runtime.cli import build_parser
from omnimodel_runtime.gateway import build_gateway_app
from omnimodel_runtime.pipeline import Vendor, parse_pipeline
from omnimodel_runtime.settings import RuntimeSettings
from omnimodel_runtime.stage.server import build_stage_app

PRODUCTS = {Vendor.NVIDIA: "H200", Vendor.AMD: "MI300X", Vendor.INTEL: "Max_1550", Vendor.ASCEND: "910B"}
# Intel and Ascend have no published runtime image: the operator is told one, as a cluster with them must be.
SETTINGS = OperatorSettings(
    runtime_images={
        **DEFAULT_RUNTIME_IMAGES,
        "intel": "registry.example.com/ml/omnimodel-runtime:xpu",
        "ascend": "registry.example.com/ml/omnimodel-runtime:cann",
    }
)


def _manifests(vendor: Vendor) -> list[dict[str, Any]]:
    accelerator: dict[str, Any] = {"vendor": vendor.value}
    if vendor is not Vendor.CPU:
        accelerator |= {"product": PRODUCTS[vendor], "count": 1}
    spec = {
        "model": {"source": "tiny://text"},
        "preset": "text",
        "gateway": {"apiKeySecret": "key"},
        "stages": [{"name": "llm", "accelerator": accelerator}],
    }
    plan = resolve("demo", "ml", spec, SETTINGS, uid="u")
    return render(plan, SETTINGS)


def _containers(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for m in manifests if m["kind"] == "Deployment" for c in m["spec"]["template"]["spec"]["containers"]]


@pytest.mark.parametrize("vendor", list(Vendor))
def test_rendered_commands_and_env_are_understood_by_the_runtime(
    vendor: Vendor, monkeypatch: pytest.MonkeyPatch
) -> None:
    containers = _containers(_manifests(vendor))
    assert {c["command"][1] for c in containers} == {"stage", "gateway"}
    for c in containers:
        assert c["command"][0] == "omnimodel"
        args = build_parser().parse_args([*c["command"][1:], *c["args"]])
        assert args.host == "0.0.0.0"
        assert args.pipeline.name == "pipeline.json"
        env = {e["name"]: e.get("value", "from-secret") for e in c["env"]}
        for name in [n for n in os.environ if n.startswith("OMNIMODEL_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            if name.startswith("OMNIMODEL_"):
                monkeypatch.setenv(name, value)
        settings = RuntimeSettings()
        fields = {f"OMNIMODEL_{name.upper()}" for name in RuntimeSettings.model_fields}
        unknown = {n for n in env if n.startswith("OMNIMODEL_")} - fields
        assert not unknown, f"the operator sets variables the runtime ignores: {unknown}"
        assert str(settings.model_cache) == env["OMNIMODEL_MODEL_CACHE"]
        assert settings.device == env["OMNIMODEL_DEVICE"]
        if "OMNIMODEL_API_KEY" in env:
            assert settings.api_key is not None


def test_probes_and_pipeline_file_fit_the_runtime_apps() -> None:
    manifests = _manifests(Vendor.NVIDIA)
    (configmap,) = [m for m in manifests if m["kind"] == "ConfigMap"]
    pipeline = parse_pipeline(configmap["data"]["pipeline.json"])
    assert all(s.endpoints for s in pipeline.stages)
    settings = RuntimeSettings()
    apps = {
        "gateway": build_gateway_app(settings, pipeline),
        "stage": build_stage_app(settings, pipeline, "llm"),
    }
    for c in _containers(manifests):
        app = apps[c["command"][1]]
        paths = {getattr(r, "path", None) for r in app.routes}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"]["path"] in paths
        port = int(c["args"][c["args"].index("--port") + 1])
        assert c["ports"][0]["containerPort"] == port
    stage_port = next(
        int(c["args"][c["args"].index("--port") + 1]) for c in _containers(manifests) if c["command"][1] == "stage"
    )
    assert all(url.endswith(f":{stage_port}") for url in pipeline.stage("llm").endpoints)


def test_runtime_looks_for_pvc_sources_where_the_operator_mounts_them() -> None:
    from pathlib import Path

    from omnimodel_operator import constants as C
    from omnimodel_runtime.settings import RuntimeSettings

    assert RuntimeSettings().pvc_root == Path(C.PVC_ROOT)
