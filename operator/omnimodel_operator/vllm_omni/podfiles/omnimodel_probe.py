"""Probes and preStop of a vLLM-Omni replica pod; shipped in the ``<cr>-pipeline`` ConfigMap.

A headless replica serves nothing of its own that tells whether the head routes to it, so each check asks
the head (``GET /omnimodel/replicas``, added by this ConfigMap's ``sitecustomize.py``) for this pod's IP:

- ``ready``: registered with the head, heartbeat current (UP), not draining: requests may come to it.
- ``started`` (startup probe): attached by the head, which answers. Until then the replica is loading
  its weights or waiting for the head's handshake; a head that does not answer yet (it is starting too)
  proves nothing, so startup goes on (passing there would hand an unattached replica to ``live``, which
  kills it 30 s later: a loaded node takes minutes to start a stage's engine).
- ``live``: registered with the head. Fails when the head detached it (0.30 never takes a detached
  replica back) or when the head is another process that never saw it (a replica of a dead head never
  registers again by itself): a restarted container registers anew and is attached. Passes while the
  head does not answer at all: that is the head's failure, not this process's.
- ``drain`` (preStop): asks the head to send it no new request, then waits until the requests bound to
  it are done (at most ``OMNIMODEL_DRAIN_SECONDS``), so the SIGTERM that follows detaches an idle replica.

Environment (set by the operator): ``POD_IP``, ``OMNIMODEL_STAGE_ID``, ``OMNIMODEL_HEAD_URL``.
Standard library only: it runs with the image's ``python3``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.parse
import urllib.request
from typing import Any


def _call(path: str, method: str = "GET") -> dict[str, Any]:
    # http:// to the head, from the operator's env (S310 guards against file: and custom schemes).
    request = urllib.request.Request(os.environ["OMNIMODEL_HEAD_URL"] + path, method=method)  # noqa: S310
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
        return dict(json.load(response))


def _mine(answer: dict[str, Any]) -> dict[str, Any] | None:
    rows = answer.get("stages", {}).get(os.environ["OMNIMODEL_STAGE_ID"], [])
    return next((r for r in rows if r.get("host") == os.environ["POD_IP"]), None)


def main(mode: str) -> int:
    if mode == "drain":
        host = urllib.parse.quote(os.environ["POD_IP"])
        deadline = time.monotonic() + float(os.environ.get("OMNIMODEL_DRAIN_SECONDS", "30"))
        try:
            row = _mine(_call(f"/omnimodel/drain?host={host}", "POST"))
            while row is not None and row.get("inFlight", 0) > 0 and time.monotonic() < deadline:
                time.sleep(0.2)
                row = _mine(_call("/omnimodel/replicas"))
        except OSError as err:
            print(f"drain: the head did not answer ({err}); stopping without draining", file=sys.stderr)
        return 0
    try:
        row = _mine(_call("/omnimodel/replicas"))
    except OSError as err:
        print(f"the head did not answer: {err}", file=sys.stderr)
        # Liveness judges this process, and a head that does not answer says nothing about it: restarting
        # it would only fail what it holds. A head that came back as another process does answer, without
        # this pod: that fails below (and the operator restarts such replicas anyway, restarts.py).
        return 0 if mode == "live" else 1
    if row is None:
        print(f"not registered with the head (pod IP {os.environ['POD_IP']})", file=sys.stderr)
        return 1
    if mode == "ready" and (not row.get("up") or row.get("draining")):
        print(f"registered but {'draining' if row.get('draining') else 'heartbeat overdue'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "ready"))
