"""The per-pod-version parse cache: reused only for the very spec and annotations it was parsed from."""

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


def test_bounded_and_uncached_without_a_uid() -> None:
    cache = ParsedPods(limit=3)
    for v in range(10):
        cache(_pod("1", str(v)))
    assert len(cache) == 3
    pod = _pod("1")
    del pod["metadata"]["uid"]
    assert cache(pod) == parse_pod(pod) and len(cache) == 3
    huge = _pod("1", "99")
    huge["metadata"]["annotations"] = {"x": "y" * 100_000}
    assert cache(huge) == parse_pod(huge) and len(cache) == 3
