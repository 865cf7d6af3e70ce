"""The test bed's cluster DNS (``omnimodel_testbed.dns``): what it answers when its API read fails."""

from __future__ import annotations

from omnimodel_testbed.dns import ClusterDNS


def test_a_failed_lookup_serves_the_last_answer_and_a_never_answered_name_none() -> None:
    answers: list[list[str] | OSError | None] = [["10.244.0.5"], OSError("handshake timed out")]

    def lookup(namespace: str, service: str) -> list[str] | None:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, OSError):
            raise answer
        return answer

    dns = ClusterDNS(lookup, host="127.0.0.1", port=0, cache_seconds=0)
    try:
        assert dns.resolve("head.ns.svc.cluster.local") == ["10.244.0.5"]
        # The API read fails now: the Service's clients keep the address they had, not a failure.
        assert dns.resolve("head.ns.svc.cluster.local") == ["10.244.0.5"]
        assert dns.resolve("other.ns.svc") is None
    finally:
        dns.stop()
