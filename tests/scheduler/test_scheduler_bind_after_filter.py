"""Filter and bind agree: a node filter passes is one bind can take, unless something really changed in between;
then bind says what.

Recorded on v1.36 under churn: ``kubegpu bind: gpu-node-11: 0 GPUs can take this, 1 needed`` 65 times. kube-scheduler
runs its cycles one at a time but binds asynchronously: pod A's bind goes out as pod B's cycle starts, so B's filter
can reach the extender before A's bind does. Counting only what is bound, the extender passed A's node for B too
and B's bind found its room taken. Now a filter counts the pods in flight (scheduler/inflight.py): it waits for the
binds that may take its room and answers from what they hold, and a bind still waiting for its turn holds its room.
Over HTTP with the real extender app; the race is made by the order of the requests, never by timing."""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from polling import until
from prometheus_client.parser import text_string_to_metric_families
from sched_harness import Cluster, mark_running, start_cluster
from test_scheduler_behaviour import args, bind, pod, share

from kubegpu.install.values import SchedulerValues
from kubegpu.model import resources as R
from kubegpu.scheduler.inflight import DEFAULT_FILTER_WAIT_S

NODE = "gpu-node-c"  # one A100
ROOT = Path(__file__).resolve().parents[2]
LONG_WAIT_S = 60.0  # what the filter may wait here: far longer than a bind posted right after takes to arrive


def _cluster(tmp_path: Path, filter_wait_s: float = LONG_WAIT_S) -> Cluster:
    api, ext = start_cluster(tmp_path, filter_wait_s=filter_wait_s)
    return Cluster(api, ext)


def _stop(cluster: Cluster) -> None:
    cluster.ext.stop()
    cluster.api.stop()


def _put(cluster: Cluster, p: dict[str, Any]) -> dict[str, Any]:
    """The pod as the API server holds it, once the extender's watch has it (filter bodies carry its UID)."""
    created = cluster.api.put_object(p)
    key = f"{p['metadata']['namespace']}/{p['metadata']['name']}"
    assert until(lambda: cluster.ext.call(lambda: cluster.ext.service.pending.get(key)) is not None)
    return created


def _bind(cluster: Cluster, p: dict[str, Any], node: str) -> str:
    r = cluster.post("/bind", {"PodName": p["metadata"]["name"], "PodNamespace": p["metadata"]["namespace"],
                               "PodUID": p["metadata"]["uid"], "Node": node})
    assert r.status_code == 200
    return str(r.json().get("Error", ""))


def _cause(error: str) -> str:
    """How ``bench/churn.py`` counts a failed bind with this error (its bind_refused_after_filter is "no-change")."""
    churn = sys.modules.get("churn_bench")
    if churn is None:
        spec = importlib.util.spec_from_file_location("churn_bench", ROOT / "bench" / "churn.py")
        assert spec is not None and spec.loader is not None
        churn = sys.modules["churn_bench"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(churn)
    cause: str = churn.bind_failure_cause(error)
    return cause


def _counters(cluster: Cluster) -> dict[str, int]:
    """What the filters did about pods in flight, as the extender's /metrics says it."""
    text = cluster.http.get("/metrics").text
    out = {outcome: 0 for outcome in ("unchecked", "checked", "waited", "refused", "expired")}
    for family in text_string_to_metric_families(text):
        if family.name == "kubegpu_filter_inflight":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["outcome"]] = int(sample.value)
    return out


def _second_filter_waits(cluster: Cluster) -> tuple[dict[str, Any], threading.Thread, list[dict[str, Any]]]:
    """w1 passed by filter; w2's filter, which comes before w1's bind, waiting for that bind: the one GPU is free
    in the accounting and w1 may take it. Returns w1, the thread that posted w2's filter and where its answer goes."""
    first = _put(cluster, pod("w1", {R.NVIDIA_GPU: "1"}))
    second = _put(cluster, pod("w2", {R.NVIDIA_GPU: "1"}))
    assert cluster.post("/filter", args(first, [NODE])).json()["NodeNames"] == [NODE]
    answer: list[dict[str, Any]] = []
    waiting = threading.Thread(target=lambda: answer.append(cluster.post("/filter", args(second, [NODE])).json()))
    waiting.start()
    assert until(lambda: _counters(cluster)["waited"] == 1)
    return first, waiting, answer


def test_a_filter_that_arrives_before_the_bind_ahead_of_it_waits_for_it_and_refuses_its_room(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    try:
        first, waiting, answer = _second_filter_waits(cluster)
        assert _bind(cluster, first, NODE) == ""
        waiting.join(30)
        assert answer and answer[0]["NodeNames"] == []  # w2 is never sent to a bind that would be refused
        assert "free whole GPUs: 0 of 1, 1 requested" in answer[0]["FailedNodes"][NODE]
        assert _counters(cluster)["expired"] == 0
    finally:
        _stop(cluster)


def test_a_filter_waiting_for_a_pod_that_is_deleted_answers_without_it(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    try:
        _, waiting, answer = _second_filter_waits(cluster)
        cluster.api.store.delete(cluster.api.kind("pods"), "default", "w1")  # the watch ends its flight
        waiting.join(30)
        assert answer and answer[0]["NodeNames"] == [NODE]
        assert _counters(cluster)["expired"] == 0
    finally:
        _stop(cluster)


def test_a_bind_waiting_for_its_turn_holds_its_room_against_the_next_filter(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """p1's bind waits for p0's handoff on the node (same kind, p0 not served yet) and holds nothing yet: p2's
    filter is refused the node with the reason, without waiting, where 20 % + 70 % alone would fit."""
    monkeypatch.delenv("KUBEGPU_HANDOFF_WAIT", raising=False)  # as deployed: pods of one kind take turns
    monkeypatch.setenv("KUBEGPU_HANDOFF_WAIT_S", "30")
    cluster = _cluster(tmp_path)
    try:
        p0 = _put(cluster, pod("p0", share(20, ratio=20)))
        p1 = _put(cluster, pod("p1", share(20, ratio=20)))
        p2 = _put(cluster, pod("p2", share(70, ratio=70)))
        assert _bind(cluster, p0, NODE) == ""  # bound, waiting for its node to serve it
        bound: list[str] = []
        binding = threading.Thread(target=lambda: bound.append(_bind(cluster, p1, NODE)))
        binding.start()
        assert until(lambda: cluster.ext.call(lambda: cluster.view.handoffs.waiting_binds.get(NODE, 0)) == 1)
        out = cluster.post("/filter", args(p2, [NODE])).json()
        assert out["NodeNames"] == []
        assert "promised to default/p1, whose bind to this node is in progress" in out["FailedNodes"][NODE]
        assert _counters(cluster)["waited"] == 0 and _counters(cluster)["refused"] == 1
        mark_running(cluster, "p0")  # p0 served: p1's turn
        binding.join(30)
        assert bound == [""]
    finally:
        _stop(cluster)


def test_a_filter_with_nothing_in_flight_or_room_for_all_does_not_wait(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    try:
        alone = _put(cluster, pod("alone", {R.NVIDIA_GPU: "1"}))
        assert cluster.post("/filter", args(alone, ["gpu-node-a"])).json()["NodeNames"] == ["gpu-node-a"]
        assert _counters(cluster) == {"unchecked": 1, "checked": 0, "waited": 0, "refused": 0, "expired": 0}
        # alone is in flight on node a (8 GPUs, all free): room for it and the next pod whatever it takes
        roomy = _put(cluster, pod("roomy", {R.NVIDIA_GPU: "2"}))
        assert cluster.post("/filter", args(roomy, ["gpu-node-a"])).json()["NodeNames"] == ["gpu-node-a"]
        assert _counters(cluster) == {"unchecked": 1, "checked": 1, "waited": 0, "refused": 0, "expired": 0}
        # a 20 % share in flight on the one GPU of node c: no count bound says a 30 % share still fits, placement does
        small = _put(cluster, pod("small", share(20, ratio=20)))
        assert cluster.post("/filter", args(small, [NODE])).json()["NodeNames"] == [NODE]
        other = _put(cluster, pod("other", share(30, ratio=30)))
        assert cluster.post("/filter", args(other, [NODE])).json()["NodeNames"] == [NODE]
        assert _counters(cluster) == {"unchecked": 1, "checked": 3, "waited": 0, "refused": 0, "expired": 0}
    finally:
        _stop(cluster)


def test_a_bind_that_never_comes_is_waited_for_once_then_no_longer_counted(tmp_path: Path) -> None:
    """kube-scheduler may fail a pod after the extender's filter (a later plugin): its bind never comes. The next
    filter waits its bound for it once, then answers without it, and so does the next pod's filter again."""
    cluster = _cluster(tmp_path, filter_wait_s=0.2)
    try:
        lost = _put(cluster, pod("lost", {R.NVIDIA_GPU: "1"}))
        assert cluster.post("/filter", args(lost, [NODE])).json()["NodeNames"] == [NODE]
        following = _put(cluster, pod("next", {R.NVIDIA_GPU: "1"}))
        for _ in range(2):
            assert cluster.post("/filter", args(following, [NODE])).json()["NodeNames"] == [NODE]
        counted = _counters(cluster)
        assert counted == {"unchecked": 2, "checked": 1, "waited": 1, "refused": 0, "expired": 1}
    finally:
        _stop(cluster)


def test_a_pod_whose_bind_never_came_is_not_waited_for_again_when_filtered_again(tmp_path: Path) -> None:
    """kube-scheduler retries a pod it fails after the filter (after back-off): each retry passes the filter again.
    Only the first costs another pod's filter a wait."""
    cluster = _cluster(tmp_path, filter_wait_s=0.2)
    try:
        lost = _put(cluster, pod("lost", {R.NVIDIA_GPU: "1"}))
        following = _put(cluster, pod("next", {R.NVIDIA_GPU: "1"}))
        for _ in range(3):  # the retries of the pod that never binds, each followed by another pod's filter
            assert cluster.post("/filter", args(lost, [NODE])).json()["NodeNames"] == [NODE]
            assert cluster.post("/filter", args(following, [NODE])).json()["NodeNames"] == [NODE]
        # Neither pod ever binds here, so each is waited for once, by the other's filter; never again after.
        assert _counters(cluster) == {"unchecked": 4, "checked": 2, "waited": 2, "refused": 0, "expired": 2}
    finally:
        _stop(cluster)


def test_a_bind_whose_room_went_to_a_pod_bound_since_its_filter_says_which(cluster: Cluster) -> None:
    """With no filter wait (the fixture's), both pods pass the one GPU: the second bind says who took it."""
    first, second = pod("w1", {R.NVIDIA_GPU: "1"}), pod("w2", {R.NVIDIA_GPU: "1"})
    for p in (first, second):
        passed = cluster.post("/filter", args(p, [NODE])).json()["NodeNames"]
        assert passed == [NODE]
    assert bind(cluster, first, NODE) == ""
    error = bind(cluster, second, NODE)
    assert error.startswith(f"kubegpu bind: {NODE}: 0 GPUs can take this, 1 needed; its filter passed the node")
    assert "taken since by pods bound there: default/w1 (GPU 0 whole" in error
    assert _cause(error) == "no-change"  # what the churn bench counts in bind_refused_after_filter


def test_a_bind_whose_room_went_without_a_bind_here_says_so(cluster: Cluster) -> None:
    p = pod("w3", {R.NVIDIA_GPU: "2"})
    error = bind(cluster, p, NODE)  # never filtered here, never fitted: no bind took anything
    assert "0 GPUs can take this" in error or "1 GPUs can take this, 2 needed" in error
    assert "this extender did not filter the pod" in error and "no pod was bound there through this extender" in error
    assert _cause(error) == "change"


def test_the_filter_wait_is_within_the_filter_extenders_timeout() -> None:
    """kube-scheduler gives up on a filter after the extender's httpTimeout: a waiting filter answers first."""
    timeout = SchedulerValues().http_timeout
    assert timeout.endswith("s") and float(timeout[:-1]) > 2 * DEFAULT_FILTER_WAIT_S


def test_a_pod_without_gpus_on_a_node_without_kubegpu_gpus_gets_a_plain_binding(cluster: Cluster) -> None:
    """The bind extender names no managed resource (install/render.py: bind has its own, longer timeout), so
    kube-scheduler sends it every pod of its profile, CPU-only pods on CPU-only nodes too."""
    plain = pod("cpu", {"cpu": "1"})
    assert bind(cluster, plain, "cpu-node-1") == ""
    bound = cluster.api.get_object("pods", "cpu", "default")
    assert bound["spec"]["nodeName"] == "cpu-node-1"
    assert "kubegpu.io/device-allocated" not in (bound["metadata"].get("annotations") or {})


def test_a_bind_waiting_for_its_turn_when_the_extender_stops_ends_at_once(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """As when its process ends: kube-scheduler's connection closes, and it does not wait out its own time-out
    (60 s as rendered) to retry the pod with the next extender."""
    monkeypatch.delenv("KUBEGPU_HANDOFF_WAIT", raising=False)
    monkeypatch.setenv("KUBEGPU_HANDOFF_WAIT_S", "30")
    cluster = _cluster(tmp_path)
    try:
        p0 = _put(cluster, pod("p0", share(20, ratio=20)))
        p1 = _put(cluster, pod("p1", share(20, ratio=20)))
        assert _bind(cluster, p0, NODE) == ""
        outcome: list[BaseException | int] = []

        def bind_p1() -> None:
            body = {"PodName": "p1", "PodNamespace": "default", "PodUID": p1["metadata"]["uid"], "Node": NODE}
            try:
                with httpx.Client(base_url=cluster.ext.url, timeout=LONG_WAIT_S) as c:
                    outcome.append(c.post("/bind", json=body).status_code)
            except httpx.TransportError as e:
                outcome.append(e)

        binding = threading.Thread(target=bind_p1)
        binding.start()
        assert until(lambda: cluster.ext.call(lambda: cluster.view.handoffs.waiting_binds.get(NODE, 0)) == 1)
        cluster.ext.stop()
        binding.join(LONG_WAIT_S)
        assert not binding.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], httpx.TransportError)
        assert not isinstance(outcome[0], httpx.TimeoutException), outcome
    finally:
        cluster.api.stop()
