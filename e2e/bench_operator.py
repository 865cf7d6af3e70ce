"""Operator benchmark on the local control plane; writes JSON.

Measures (DESIGN §8): time from `kubectl apply` to all children created and to Ready for one OmniModel
whose pods really get scheduled; the same for N OmniModels applied at once (stages at replicas 0, so the
fake fleet's pod capacity is not the bottleneck); then the operator idle over all of them: API requests
it sends per minute beyond its watch streams (target <= 1 per object per 10 minutes), with the
safety-net pass shortened to --idle-resync seconds so that the window holds full passes over every
object; and the operator's resident memory.

    PYTHONPATH=e2e .venv/bin/python e2e/bench_operator.py --count 1000 --out bench/results/operator.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

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


def all_settled(kube: Kube) -> tuple[int, int]:
    """OmniModels whose status describes their current spec rolled out: Ready with every stage available,
    or (the fleet here runs at zero replicas) Ready=False/ScaledToZero, the truthful terminal state."""
    items = kube.get("omnimodels")["items"]
    settled = 0
    for item in items:
        gen = item["metadata"].get("generation")
        for c in (item.get("status") or {}).get("conditions") or []:
            current = c["type"] == "Ready" and c.get("observedGeneration") == gen
            if current and (c["status"], c["reason"]) in (("True", "AllStagesReady"), ("False", "ScaledToZero")):
                settled += 1
    return settled, len(items)


def counters(operator: Operator) -> dict[str, float]:
    """Requests by verb, and passes by trigger, from the operator's own /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(operator.scrape()):
        for sample in family.samples:
            if sample.name == "omnimodel_operator_api_requests_total":
                key = f"requests.{sample.labels['verb']}"
            elif sample.name == "omnimodel_operator_reconciles_total":
                key = f"passes.{sample.labels['trigger']}"
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--single-runs", type=int, default=5)
    parser.add_argument("--idle-seconds", type=float, default=180.0)
    parser.add_argument("--idle-resync", type=float, default=60.0, help="safety-net interval during the run")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "operator.json")
    args = parser.parse_args()

    result: dict[str, Any] = {"count": args.count}
    with session_cluster() as cluster:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "omnimodel.io_omnimodels.yaml"))
        # Shipped settings, except a shorter safety-net pass so that the idle window holds several.
        operator = Operator(
            cluster,
            Path(tempfile.mkdtemp(prefix="omnimodel-bench-")),
            env={"OMNIMODEL_RESYNC_INTERVAL": str(args.idle_resync)},
        )
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
                wait_for(lambda kube=kube, name=name: children(kube, name) == 3, 300, interval=0.05)
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
            wait_for(lambda: all_settled(kube)[0] == args.count, 1800, interval=2.0, what="every status settled")
            t_ready = time.perf_counter() - t0
            result["many"] = {
                "kubectl_apply_s": round(t_applied, 2),
                "all_children_s": round(t_children, 2),
                "all_settled_s": round(t_ready, 2),
                "reconciles_per_s": round(args.count / t_children, 1),
                "note": "stages and gateway at replicas 0: measures the operator, not pod capacity; settled = "
                "status describes the current generation with every Deployment rolled out (Ready=False/"
                "ScaledToZero here, the truthful state of a model scaled to nothing)",
            }
            # Let the last rollouts' events drain, then measure a quiet cluster.
            last = [counters(operator)]

            def quiet() -> bool:
                now = counters(operator)
                same = now == last[0]
                last[0] = now
                return same

            wait_for(quiet, 300, interval=10.0, what="no pass and no request for 10 s")
            before = counters(operator)
            t0 = time.perf_counter()
            time.sleep(args.idle_seconds)  # the measurement window itself, not synchronisation
            after = counters(operator)
            minutes = (time.perf_counter() - t0) / 60
            requests = {
                k.split(".", 1)[1]: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("requests.")
            }
            total = sum(requests.values())
            assert operator.proc is not None
            result["idle"] = {
                "window_s": round(minutes * 60, 1),
                "resync_interval_s": args.idle_resync,
                "safety_net_passes": after.get("passes.resync", 0) - before.get("passes.resync", 0),
                "api_requests": {k: v for k, v in requests.items() if v},
                "api_requests_per_min": round(total / minutes, 2),
                "per_object_per_10_min": round(total / minutes * 10 / args.count, 4),
                "note": "beyond kopf's watch streams (one per watched kind); target <= 1 per object per 10 min",
            }
            result["operator_rss_mib"] = rss_mib(operator.proc.pid)
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
