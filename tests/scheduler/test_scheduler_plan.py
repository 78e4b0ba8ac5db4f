"""One plan per pod version: filter, prioritize and bind over the real HTTP app parse a pod once per
resourceVersion (kube-scheduler's CycleState, keyed by UID and resourceVersion), and a new version is
parsed afresh."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from sched_harness import Cluster
from test_scheduler_behaviour import ALL, args, pod

from kubegpu.model.request import PodRequest
from kubegpu.scheduler import plan as plan_module
from kubegpu.scheduler.plan import PlanCache, PlanSettings


def _counting(monkeypatch: pytest.MonkeyPatch) -> Counter[tuple[str, str]]:
    """parse_pod calls by (pod name, resourceVersion), wherever the extender plans a pod."""
    calls: Counter[tuple[str, str]] = Counter()
    real = plan_module.parse_pod

    def counted(p: Any, **kw: Any) -> PodRequest:
        meta = p.get("metadata") or {}
        calls[(str(meta.get("name")), str(meta.get("resourceVersion")))] += 1
        return real(p, **kw)

    monkeypatch.setattr(plan_module, "parse_pod", counted)
    return calls


def test_one_parse_per_pod_version_through_filter_prioritize_and_bind(cluster: Cluster,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting(monkeypatch)
    created = cluster.api.put_object(pod("once", {"nvidia.com/gpu": "1"}))
    version = created["metadata"]["resourceVersion"]
    r = cluster.post("/filter", args(created, ALL))
    assert r.status_code == 200 and r.json()["NodeNames"]
    node = r.json()["NodeNames"][0]
    assert cluster.post("/prioritize", args(created, ALL)).status_code == 200
    r = cluster.post("/bind", {"PodName": "once", "PodNamespace": "default", "PodUID": created["metadata"]["uid"],
                               "Node": node})
    assert r.status_code == 200 and not r.json().get("Error")
    assert calls[("once", version)] == 1

    changed = {**created, "metadata": {**created["metadata"], "resourceVersion": version + "0"}}
    assert cluster.post("/filter", args(changed, ALL)).status_code == 200
    assert calls[("once", version + "0")] == 1


def test_the_plan_cache_is_bounded_and_keyed_by_uid_and_version() -> None:
    cache = PlanCache(PlanSettings(), limit=3)
    pods = [pod(f"p{i}", {"nvidia.com/gpu": "1"}) for i in range(5)]
    for i, p in enumerate(pods):
        p["metadata"].update(uid=f"u{i}", resourceVersion="1")
    plans = [cache.plan(p) for p in pods]
    assert len(cache) == 3
    assert cache.plan(pods[4]) is plans[4] and cache.plan(pods[0]) is not plans[0]
    newer = {**pods[4], "metadata": {**pods[4]["metadata"], "resourceVersion": "2"}}
    assert cache.plan(newer) is not plans[4] and cache.plan(newer).request == plans[4].request
    anonymous = pod("anon", {"nvidia.com/gpu": "1"})  # no UID or version: planned each time, never kept
    assert cache.plan(anonymous) is not cache.plan(anonymous)
