"""The command-line check the operator's vLLM-Omni renders go through: vLLM-Omni's own serve parser
(e2e/vllm-omni/validate_cmdline.py, in the cached vLLM-Omni env) accepts real head and replica command
lines and names the flag of a bad one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omnimodel_testbed.vllm_omni import validate_command_lines

pytestmark = pytest.mark.vllm_omni

REPO = Path(__file__).parents[1]

MODEL = "/models/Qwen/Qwen3-Omni-30B-A3B-Instruct"  # an in-container path: absent here, and that is fine
HEAD = ["vllm", "serve", MODEL, "--omni", "--deploy-config", "qwen3_omni_moe.yaml", "--stage-id", "0",
        "--omni-master-address", "$(POD_IP)", "--omni-master-port", "15000", "--host", "0.0.0.0", "--port", "8000",
        "--stage-overrides", '{"0": {"devices": "0,1", "tensor_parallel_size": 2}}']  # fmt: skip
REPLICA = ["vllm", "serve", MODEL, "--omni", "--deploy-config", "qwen3_omni_moe.yaml", "--headless",
           "--stage-id", "1", "-oma", "qwen-head-0.qwen-head.ml.svc", "-omp", "15000", "-ora", "$(POD_IP)",
           "--stage-overrides", '{"1": {"devices": "0"}}']  # fmt: skip


def test_rendered_command_lines_parse_and_bad_flags_are_named() -> None:
    bad = {
        "--omni-lb-policy": [*REPLICA, "--omni-lb-policy", "fastest"],
        "--stage-id": [*REPLICA[:8], "9", *REPLICA[9:]],
        "--stage-overrides": [*HEAD[:-1], '{"7": {"devices": "0"}}'],
        "--no-such-flag": [*HEAD, "--no-such-flag", "1"],
        "--deploy-config": [*HEAD[:5], "qwen3_omni_moe", *HEAD[6:]],  # a bundled name needs its .yaml
    }
    verdicts = validate_command_lines([HEAD, REPLICA, *bad.values()])
    assert [(v.ok, v.flag) for v in verdicts[:2]] == [(True, None), (True, None)], verdicts[:2]
    for flag, verdict in zip(bad, verdicts[2:], strict=True):
        assert not verdict.ok
        assert verdict.flag == flag, verdict


def test_what_the_operator_renders_validates_with_vllm_omnis_parser(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acceptance CR (qwen3_omni_moe across H200, MI300X and L40S), the tiny Qwen2.5-Omni of the e2e
    suite and a single-stage image model: every head and replica command line parses and validates,
    against the very deploy file the operator writes (interpolations resolved from the pod's env)."""
    from omnimodel_operator.runtimes import render, resolve
    from omnimodel_operator.settings import OperatorSettings

    monkeypatch.setenv("POD_IP", "10.244.0.9")  # the deploy file's ${oc.env:POD_IP}
    sample = yaml.safe_load((REPO / "examples" / "vllm-omni-qwen3-omni.yaml").read_text())
    specs = {
        "qwen3-omni": sample["spec"],
        "omni": {"model": {"source": "file:///models/tiny/omni"}, "runtime": {"kind": "vllm-omni",
                 "deployConfig": "qwen2_5_omni", "extraArgs": ["--dtype", "float32"]},
                 "stages": [{"name": "talker", "replicas": 2,
                             "engineArgs": {"default_sampling_params": {"max_tokens": 24}}}]},
        "img": {"model": {"source": "file:///models/tiny/qwen-image"}, "runtime": {"kind": "vllm-omni"},
                "stages": [{"name": "dit", "replicas": 3, "accelerator": {"vendor": "nvidia", "count": 2},
                            "engineArgs": {"tensor_parallel_size": 2}}]},
    }  # fmt: skip
    argvs: list[list[str]] = []
    for name, spec in specs.items():
        children = render(resolve(name, "ml", spec, OperatorSettings(), uid="u"), OperatorSettings())
        deploy = tmp_path / name / "deploy.yaml"
        deploy.parent.mkdir()
        configmap = next(c for c in children if c["kind"] == "ConfigMap")
        deploy.write_text(configmap["data"]["deploy.yaml"])
        for child in children:
            if (
                child["kind"] == "Deployment"
                and child["spec"]["template"]["spec"]["containers"][0]["command"][0] == "vllm"
            ):
                container = child["spec"]["template"]["spec"]["containers"][0]
                argv = [*container["command"], *container["args"]]
                argvs.append([str(deploy) if a == "/etc/omnimodel/deploy.yaml" else a for a in argv])
    assert len(argvs) == 3 + 3 + 2  # heads and replica Deployments of the three
    verdicts = validate_command_lines(argvs)
    assert [v.message for v in verdicts if not v.ok] == []
