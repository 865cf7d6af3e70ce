"""The command-line check the operator's vLLM-Omni renders go through: vLLM-Omni's own serve parser
(e2e/vllm-omni/validate_cmdline.py, in the cached vLLM-Omni env) accepts real head and replica command
lines and names the flag of a bad one."""

from __future__ import annotations

import pytest

from omnimodel_testbed.vllm_omni import validate_command_lines

pytestmark = pytest.mark.vllm_omni

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
