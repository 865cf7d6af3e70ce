"""Operator benchmark on the local control plane; writes JSON.

Measures (DESIGN §8): time from `kubectl apply` to all children created and to Ready for one OmniModel
whose pods really get scheduled; the same for N OmniModels applied at once (stages at replicas 0, so the
fake fleet's pod capacity is not the bottleneck); and API writes made by a no-op reconcile pass over all of
them (target 0).

    python e2e/bench_operator.py --count 200 --out bench/results/operator.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from omnimodel_operator.kube import HttpKube, load_connection
from omnimodel_operator.reconcile import reconcile
from omnimodel_operator.settings import OperatorSettings
from omnimodel_testbed.pytest_plugin import session_cluster
from support import Kube, Operator, wait_for

REPO = Path(__file__).parents[1]


def omnimodel(name: str, replicas: int | None) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "tts.yaml").read_text())
    doc["metadata"]["name"] = name
    stages = doc["spec"]["stages"]
    if replicas is not None:
        stages[0].pop("autoscaling")
        for stage in stages:
            stage["replicas"] = replicas
        doc["spec"]["gateway"] = {"replicas": replicas}
    return doc


def children(kube: Kube, name: str) -> int:
    items = kube.get("deployments", selector=f"app.kubernetes.io/instance={name}")["items"]
    return len(items)


def all_ready(kube: Kube) -> tuple[int, int]:
    items = kube.get("omnimodels")["items"]
    ready = 0
    for item in items:
        for c in (item.get("status") or {}).get("conditions") or []:
            if c["type"] == "Ready" and c["status"] == "True":
                ready += 1
    return ready, len(items)


class Counting:
    def __init__(self, inner: HttpKube) -> None:
        self.inner = inner
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name not in ("apply", "delete", "patch_status", "create"):
            return attr

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.writes += 1
            return await attr(*args, **kwargs)

        return counted


async def noop_pass(kubeconfig: str, namespace: str) -> dict[str, Any]:
    client = HttpKube(load_connection(kubeconfig))
    counting = Counting(client)
    started = time.perf_counter()
    try:
        listing = await client._request("GET", f"/apis/omnimodel.io/v1alpha1/namespaces/{namespace}/omnimodels")
        for body in listing["items"]:
            await reconcile(counting, body, OperatorSettings())  # type: ignore[arg-type]
    finally:
        await client.aclose()
    return {
        "objects": len(listing["items"]),
        "writes": counting.writes,
        "seconds": round(time.perf_counter() - started, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--single-runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "operator.json")
    args = parser.parse_args()

    result: dict[str, Any] = {"count": args.count}
    with session_cluster() as cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "omnimodel.io_omnimodels.yaml"))
        # The operator's default status cadence (the e2e suite uses 1 s to keep its waits short).
        operator = Operator(cluster, Path(tempfile.mkdtemp(prefix="omnimodel-bench-")))
        operator.start()
        try:
            singles: list[dict[str, float]] = []
            for i in range(args.single_runs):
                ns = f"bench-{uuid.uuid4().hex[:6]}"
                cluster.kubectl("create", "namespace", ns)
                kube = Kube(cluster, ns)
                name = f"one-{i}"
                t0 = time.perf_counter()
                kube.apply(omnimodel(name, None))
                wait_for(lambda kube=kube, name=name: children(kube, name) == 3, 60, interval=0.05)
                t_children = time.perf_counter() - t0
                kube.wait_ready(name)
                singles.append({"children_s": t_children, "ready_s": time.perf_counter() - t0})
                cluster.kubectl("delete", "namespace", ns, "--wait=false")
            result["single"] = {
                "runs": len(singles),
                "median_children_s": round(statistics.median(s["children_s"] for s in singles), 3),
                "median_ready_s": round(statistics.median(s["ready_s"] for s in singles), 3),
                "note": "tts example: 2 stages + gateway, pods scheduled on the fake fleet and marked Ready by kwok",
            }

            ns = f"bench-{uuid.uuid4().hex[:6]}"
            cluster.kubectl("create", "namespace", ns)
            kube = Kube(cluster, ns)
            docs = "\n---\n".join(yaml.safe_dump(omnimodel(f"m{i:03d}", 0)) for i in range(args.count))
            t0 = time.perf_counter()
            kube.apply(docs)
            t_applied = time.perf_counter() - t0

            def every_child() -> bool:
                n = len(kube.get("deployments")["items"])
                return n == 3 * args.count

            wait_for(every_child, 1200, interval=1.0, what="all children")
            t_children = time.perf_counter() - t0
            wait_for(lambda: all_ready(kube)[0] == args.count, 1200, interval=1.0, what="all Ready")
            t_ready = time.perf_counter() - t0
            result["many"] = {
                "kubectl_apply_s": round(t_applied, 2),
                "all_children_s": round(t_children, 2),
                "all_ready_s": round(t_ready, 2),
                "reconciles_per_s": round(args.count / t_children, 1),
                "note": "stages and gateway at replicas 0: measures the operator, not pod capacity",
            }
            result["noop_pass"] = asyncio.run(noop_pass(str(cluster.kubeconfig), ns))
            cluster.kubectl("delete", "namespace", ns, "--wait=false")
        finally:
            operator.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
