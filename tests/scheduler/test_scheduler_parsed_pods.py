"""The parse cache: reused only for the very request (what the parser reads) it was parsed from."""

from __future__ import annotations

from typing import Any

from kubegpu.model.request import parse_pod
from kubegpu.scheduler.parsed import ParsedPods


def _pod(gpus: str, version: str = "7") -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "resourceVersion": version},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}}


def test_same_version_is_parsed_once() -> None:
    cache = ParsedPods()
    first = cache(_pod("2"))
    assert cache(_pod("2")) is first and first == parse_pod(_pod("2"))


def test_a_body_claiming_the_same_version_with_another_spec_is_parsed_afresh() -> None:
    cache = ParsedPods()
    cache(_pod("2"))
    forged = cache(_pod("8"))
    assert forged == parse_pod(_pod("8")) != parse_pod(_pod("2"))


def test_a_dict_changed_in_place_is_not_answered_from_before() -> None:
    cache = ParsedPods()
    pod = _pod("2")
    cache(pod)
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "4"
    assert cache(pod) == parse_pod(pod)


def test_bounded() -> None:
    cache = ParsedPods(limit=3)
    for n in range(10):
        cache(_pod(str(n + 1)))
    assert len(cache) == 3
    pod = _pod("10")
    del pod["metadata"]["uid"]
    assert cache(pod) == parse_pod(pod) and len(cache) == 3
    huge = _pod("1", "99")
    huge["spec"]["containers"][0]["resources"]["limits"]["x"] = "y" * 100_000
    assert cache(huge) == parse_pod(huge) and len(cache) == 3


def test_kept_by_what_the_parser_reads() -> None:
    """Another version, another copy or another pod with the same request shares the result; anything the
    parser reads (a container's resources or name, the allowed GPU models) makes it parse afresh."""
    cache = ParsedPods()
    first = cache(_pod("2"))
    other = _pod("2", "8")
    other["metadata"].update(uid="u-2", annotations={"kubegpu.io/device-allocated": "{}", "note": "x"})
    other["spec"]["containers"][0].update(image="cuda", env=[{"name": "A", "value": "B"}])
    other["spec"]["nodeName"] = "n1"
    assert cache(other) is first
    for change in (lambda p: p["spec"]["containers"][0].update(name="d"),
                   lambda p: p["spec"]["containers"][0]["resources"].update(requests={"nvidia.com/gpu": "3"}),
                   lambda p: p["metadata"].update(annotations={"kubegpu.io/gpu-model": "A100"}),
                   lambda p: p["metadata"].update(annotations={"scheduler.alpha.kubernetes.io/affinity": "{}"}),
                   lambda p: p["spec"].update(initContainers=[{"name": "i", "resources": {}}]),
                   lambda p: p["spec"].update(containers="not-a-list")):
        changed = _pod("2")
        change(changed)
        assert cache(changed) == parse_pod(changed)
        assert cache(changed) is not first or parse_pod(changed) == parse_pod(_pod("2"))
