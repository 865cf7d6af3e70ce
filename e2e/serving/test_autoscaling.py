"""The operator's own autoscaler on real traffic: gateway and stage processes behind kwok pods, the
operator at its shipped OMNIMODEL_AUTOSCALE_INTERVAL (10 s), requests from the official openai client.

What a user notices: load raises a stage's replicas and the new pods serve; a lull brings them back
down after the stage's scale-down window; a stage at ``minReplicas: 0`` idles at zero under traffic
that does not need it and wakes for the first request that does, which succeeds.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from omnimodel_testbed.kubelet import PodRunner
from support import Kube, example, healthy, stage_requests, wait_for

# The operator's shipped decision interval (settings.autoscale_interval); the tests never shorten it.
INTERVAL = 10.0
MANAGER = "omnimodel-autoscaler"


@dataclass
class Timeline:
    """Each Deployment's spec.replicas whenever it was looked at, kept when it changed."""

    kube: Kube
    started: float = field(default_factory=time.monotonic)
    changes: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def replicas(self, deployment: str) -> int:
        obj = self.kube.get("deployment", deployment)
        assert obj is not None, f"Deployment {deployment} is gone"
        n = int(obj["spec"].get("replicas", 1))
        seen = self.changes.setdefault(deployment, [])
        if not seen or seen[-1][1] != n:
            seen.append((round(time.monotonic() - self.started, 1), n))
        return n

    def show(self) -> str:
        return "; ".join(
            f"{name}: " + " -> ".join(f"{n} @{t:g}s" for t, n in points) for name, points in self.changes.items()
        )


@dataclass
class Load:
    """``workers`` clients, each sending one chat at a time until stopped: bounded concurrency."""

    base: str
    model: str
    workers: int
    done: int = 0
    stopped_at: float = 0.0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _work(self, i: int) -> None:
        client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=120)
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": f"w{i} q{n}"}], max_tokens=32
                )
            except openai.OpenAIError as err:
                with self._lock:
                    self.errors.append(f"{type(err).__name__}: {err}")
                continue
            with self._lock:
                self.done += 1

    @contextmanager
    def running(self) -> Iterator[Load]:
        threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(self.workers)]
        for t in threads:
            t.start()
        try:
            yield self
        finally:
            self.stopped_at = time.monotonic()
            self._stop.set()
            for t in threads:
                t.join(timeout=150)


def served(url: str) -> float:
    """Requests a stage process has finished; 0 while it does not answer yet (still loading)."""
    try:
        return stage_requests(url)
    except httpx.HTTPError:
        return 0.0


def autoscaler_status(kube: Kube, name: str, stage: str) -> dict[str, Any] | None:
    obj = kube.get("omnimodel", name) or {}
    for s in (obj.get("status") or {}).get("stages") or []:
        if s.get("name") == stage:
            auto: dict[str, Any] | None = s.get("autoscaler")
            return auto
    return None


def scaled_events(kube: Kube, name: str) -> list[str]:
    items = (kube.get("events") or {}).get("items") or []
    return [e["message"] for e in items if e.get("reason") == "Scaled" and e["involvedObject"]["name"] == name]


def managers(kube: Kube, deployment: str) -> set[str]:
    """The field managers of a Deployment (kubectl hides managedFields unless asked).

    Only the absence of the autoscaler's manager says something: the API server records a scale
    subresource write under its manager only when a manager already owned ``spec.replicas``, and the
    operator's server-side apply leaves replicas out for autoscaled stages."""
    obj = json.loads(kube.run("get", "deployment", deployment, "-o", "json", "--show-managed-fields").stdout)
    return {m["manager"] for m in obj["metadata"].get("managedFields") or []}


@pytest.mark.timeout(900)
def test_load_scales_a_stage_up_and_a_lull_back_down(kube: Kube, pods: PodRunner) -> None:
    window = 30
    doc = example("text-tiny.yaml")
    doc["spec"]["stages"][0]["autoscaling"] = {"maxReplicas": 3, "target": 1, "scaleDownWindowSeconds": window}
    kube.apply(doc)
    kube.wait_ready("text-tiny")
    base = f"http://text-tiny-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 180, interval=0.5, what="gateway /health 200 (stage loaded and warm)")
    timeline = Timeline(kube)
    deployment = "text-tiny-llm"
    assert timeline.replicas(deployment) == 1
    (first,) = pods.processes(deployment)

    with Load(base, "text", workers=6).running() as load:
        # Six requests in flight for a target of one per replica: max (3) within about one interval.
        wait_for(lambda: timeline.replicas(deployment) == 3, 3 * INTERVAL + 30, interval=1, what="3 replicas")
        scaled_up = time.monotonic()
        wait_for(lambda: len(pods.processes(deployment)) == 3, 60, what="three stage processes")
        added = [p for p in pods.processes(deployment) if p.uid != first.uid]
        # The new pods serve: the gateway found them through the headless Service and balances to them.
        wait_for(
            lambda: all(served(f"http://{p.ip}:8001") > 0 for p in added),
            300,
            interval=2,
            what="requests served by both added pods",
        )
        served_by_added = [served(f"http://{p.ip}:8001") for p in added]
        status = autoscaler_status(kube, "text-tiny", "llm")
        assert status is not None
        assert (status["kind"], status["metric"], status["target"]) == ("OmniModelAutoscaler", "inFlight", 1)
        # Still loaded, it does not shrink.
        assert timeline.replicas(deployment) == 3
    assert not load.errors, load.errors[:5]
    assert load.done > 0

    wait_for(lambda: timeline.replicas(deployment) == 1, window + 4 * INTERVAL + 30, interval=1, what="back to 1")
    lull = time.monotonic() - load.stopped_at
    # The window holds the highest recommendation of its last `window` seconds; the last sample under
    # full load was at most one interval (plus a scrape, up to its 2 s timeout) before the load stopped.
    assert lull >= window - INTERVAL - 2, f"scaled down {lull:.0f}s after the load stopped, window {window}s"
    wait_for(lambda: len(pods.processes(deployment)) == 1, 60, what="the added pods stopped")
    status = autoscaler_status(kube, "text-tiny", "llm")
    assert status is not None and status["desiredReplicas"] == 1, status
    events = wait_for(lambda: scaled_events(kube, "text-tiny"), 30, what="Scaled events")
    # Up and down in one step or more (a decision may sample the load while it ramps or drains).
    assert any("-> 3 replicas" in m for m in events) and any("-> 1 replicas" in m for m in events), events
    assert MANAGER not in managers(kube, "text-tiny-gateway")
    print(
        f"\nreplicas: {timeline.show()}; up to 3 reached, added pods served {served_by_added} requests "
        f"({time.monotonic() - scaled_up:.0f}s after scale-up incl. lull); {load.done} requests ok; "
        f"back to 1 {lull:.0f}s after the load stopped (window {window}s)"
    )


@pytest.mark.timeout(1200)
def test_stages_at_zero_idle_under_text_and_wake_for_audio(kube: Kube, pods: PodRunner) -> None:
    idle = 30
    doc = example("qwen-omni-tiny.yaml")
    for stage in doc["spec"]["stages"]:
        # The test bed's nodes have no devices: every stage on a CPU node, as the processes run here.
        stage["accelerator"] = {"vendor": "cpu"}
        if stage["name"] in ("talker", "code2wav"):
            stage["autoscaling"] = {
                "minReplicas": 0,
                "maxReplicas": 2,
                "idleSecondsToZero": idle,
                # A held request fails with a 503 after this: bounds how long a broken wake-up is waited on.
                "wakeTimeoutSeconds": 150,
            }
    kube.apply(doc)
    kube.wait_ready("omni-tiny", timeout=180)
    base = f"http://omni-tiny-gateway.{kube.ns}.svc:8000"
    wait_for(lambda: healthy(base), 300, interval=0.5, what="gateway /health 200")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=360)
    model = client.models.list().data[0].id
    timeline = Timeline(kube)
    sleepers = ("omni-tiny-talker", "omni-tiny-code2wav")

    def text_chat() -> bool:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], modalities=["text"], max_tokens=4
        )
        assert reply.choices[0].message.content is not None
        assert reply.choices[0].message.audio is None
        return True

    def at_zero() -> bool:
        text_chat()
        return all(timeline.replicas(d) == 0 for d in sleepers)

    # Text traffic needs neither talker nor code2wav: after idleSecondsToZero they go to zero.
    wait_for(at_zero, idle + 4 * INTERVAL + 120, interval=1, what="talker and code2wav at 0 under text traffic")
    wait_for(lambda: not pods.processes("omni-tiny-talker") and not pods.processes("omni-tiny-code2wav"), 60,
             what="their processes stopped")  # fmt: skip
    # ... and stay there for several more decisions of text traffic; the gateway stays healthy.
    until = time.monotonic() + 3 * INTERVAL
    while time.monotonic() < until:
        assert at_zero(), timeline.show()
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200
    assert kube.condition("omni-tiny")["status"] == "True"  # type: ignore[index]

    # The first audio chat is held by the gateway while the autoscaler wakes what it needs.
    asked = time.monotonic()
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something, out loud."}],
        modalities=["text", "audio"],
        max_tokens=8,
        seed=1,
    )
    wake_latency = time.monotonic() - asked
    audio = reply.choices[0].message.audio
    assert audio is not None
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as w:
        assert (w.getnchannels(), w.getframerate()) == (1, 24000)
        assert w.getnframes() > 0
    assert all(timeline.replicas(d) >= 1 for d in sleepers), timeline.show()
    talker = autoscaler_status(kube, "omni-tiny", "talker")
    assert talker is not None and talker["kind"] == "OmniModelAutoscaler", talker
    # A warm second audio chat, for comparison with the wake-up.
    asked = time.monotonic()
    client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "again"}], modalities=["text", "audio"], max_tokens=8
    )
    warm = time.monotonic() - asked

    # The thinker has no autoscaling: the autoscaler never touched it.
    assert timeline.replicas("omni-tiny-thinker") == 1
    assert MANAGER not in managers(kube, "omni-tiny-thinker")
    events = scaled_events(kube, "omni-tiny")
    assert all("thinker" not in m for m in events), events
    print(
        f"\nwake-up latency (first audio chat, talker and code2wav at 0): {wake_latency:.1f}s; warm audio chat "
        f"{warm:.1f}s; replicas: {timeline.show()}; events: {events}"
    )
