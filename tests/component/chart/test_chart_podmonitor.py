"""The vLLM-Omni PodMonitor: off by default; when on, it selects exactly the head pods the operator
renders and scrapes their API port, where vLLM-Omni 0.30 reports every stage."""

from __future__ import annotations

from chartkit import NAMESPACE, Render, RenderError, find, kinds

from omnimodel_operator.runtimes import render as render_children
from omnimodel_operator.runtimes import resolve
from omnimodel_operator.settings import OperatorSettings

MONITOR = "omni-omnimodel-operator-vllm-omni"


def head_and_replica_pods() -> tuple[dict[str, str], dict[str, str], list[str]]:
    """Pod labels of a vLLM-Omni head and of a replica, and the head container's port names."""
    spec = {"model": {"source": "hf://org/model"}, "runtime": {"kind": "vllm-omni", "deployConfig": "qwen2_5_omni"}}
    out = {
        m["metadata"]["name"]: m
        for m in render_children(resolve("omni", "ml", spec, OperatorSettings()), OperatorSettings())
    }
    head, talker = out["omni-thinker"]["spec"]["template"], out["omni-talker"]["spec"]["template"]
    ports = [p["name"] for p in head["spec"]["containers"][0]["ports"]]
    return head["metadata"]["labels"], talker["metadata"]["labels"], ports


def test_no_pod_monitor_by_default(render: Render) -> None:
    assert "PodMonitor" not in kinds(render())


def test_the_pod_monitor_scrapes_the_heads_api_port_and_no_replica(render: Render) -> None:
    values = {
        "vllmOmniPodMonitor": {
            "enabled": True,
            "interval": "15s",
            "scrapeTimeout": "10s",
            "labels": {"release": "prom"},
        }
    }
    monitor = find(render(values), "PodMonitor", MONITOR, NAMESPACE)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    head, replica, ports = head_and_replica_pods()
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= head.items()
    assert not selector.items() <= replica.items()
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "scheme": "http", "interval": "15s", "scrapeTimeout": "10s"}
    assert endpoint["port"] in ports


def test_the_pod_monitor_follows_the_watched_namespaces_unless_told(render: Render) -> None:
    watched = render({"watchNamespaces": ["ml", "team-a"], "vllmOmniPodMonitor": {"enabled": True}})
    assert find(watched, "PodMonitor", MONITOR)["spec"]["namespaceSelector"] == {"matchNames": ["ml", "team-a"]}
    told = render({"watchNamespaces": ["ml"], "vllmOmniPodMonitor": {"enabled": True, "namespaces": ["serving"]}})
    monitor = find(told, "PodMonitor", MONITOR)
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "http", "path": "/metrics", "scheme": "http", "interval": "30s"}
    ]


def test_a_bad_interval_is_refused_by_the_schema(render_error: RenderError) -> None:
    assert "interval" in render_error({"vllmOmniPodMonitor": {"enabled": True, "interval": "soon"}})
