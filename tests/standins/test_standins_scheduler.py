"""The stand-in kube-scheduler: in-tree fit and node affinity first, then the extender's verbs over HTTP
with the recorded v1.24 bodies; pods without a managed resource are bound by the default binder."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kubegpu.kube.client import make_client
from kubegpu.kube.writes import bind_pod
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.scheduler import StandinScheduler, node_affinity_mismatch


class FakeExtender:
    """Records every verb call; keeps the nodes named in ``keep``, scores by ``scores``, binds through the API."""

    def __init__(self, client: Any) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.keep: set[str] | None = None
        self.scores: dict[str, int] = {}
        self.fail_filter = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                verb = self.path.rsplit("/", 1)[-1]
                outer.calls.append((verb, body))
                args = json.loads(body)
                if verb == "filter":
                    if outer.fail_filter:
                        self._send(500, {"error": "boom"})
                        return
                    names = [n for n in args["NodeNames"] if outer.keep is None or n in outer.keep]
                    failed = {n: "no GPU fits" for n in args["NodeNames"] if n not in names}
                    self._send(200, {"Nodes": None, "NodeNames": names, "FailedNodes": failed, "Error": ""})
                elif verb == "prioritize":
                    self._send(200, [{"Host": n, "Score": outer.scores.get(n, 0)} for n in args["NodeNames"]])
                elif verb == "bind":
                    bind_pod(client, args["PodNamespace"], args["PodName"], args["PodUID"], args["Node"])
                    self._send(200, {"Error": ""})

            def _send(self, code: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/scheduler"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def verbs(self) -> list[str]:
        return [v for v, _ in self.calls]


def _node(name: str, gpus: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    alloc = {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "status": {"capacity": alloc, "allocatable": alloc,
                       "conditions": [{"type": "Ready", "status": "True"}]}}


def _pod(name: str, limits: dict[str, str], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "x", "resources": {"limits": limits}}], **spec}}


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[ApiServer, FakeExtender, StandinScheduler]]:
    api = ApiServer().start()
    client = make_client(api.write_kubeconfig(tmp_path / "kc"))
    ext = FakeExtender(client)
    sched = StandinScheduler(client, ext.url, managed={"nvidia.com/gpu"})
    try:
        yield api, ext, sched
    finally:
        sched.http.close()
        ext.server.shutdown()
        api.stop()


def _create(sched: StandinScheduler, pod: dict[str, Any]) -> None:
    from kubegpu.kube.resources import Pod

    sched.client.create(Pod.from_dict(pod))


def test_gpu_pod_goes_through_filter_prioritize_bind_with_recorded_bodies(env: Any) -> None:
    api, ext, sched = env
    for n in (_node("a", 2), _node("b", 2), _node("c", 0)):
        api.put_object(n)
    ext.scores = {"a": 1, "b": 7}
    _create(sched, _pod("p", {"nvidia.com/gpu": "1"}))
    [result] = sched.schedule_pending()
    assert result.node == "b" and result.pod == "default/p"
    assert ext.verbs() == ["filter", "prioritize", "bind"]
    body = ext.calls[0][1].decode()
    assert body.startswith('{"Pod":{') and ',"Nodes":null,"NodeNames":["a","b"]}' in body  # c: Insufficient
    assert '"kind"' not in body.split('"Nodes"')[0][:20]  # the cached pod has no kind/apiVersion
    bind = json.loads(ext.calls[2][1])
    assert list(bind) == ["PodName", "PodNamespace", "PodUID", "Node"] and bind["Node"] == "b"
    assert api.get_object("pods", "p", namespace="default")["spec"]["nodeName"] == "b"


def test_one_surviving_node_skips_prioritize(env: Any) -> None:
    api, ext, sched = env
    api.put_object(_node("a", 1))
    api.put_object(_node("b", 1))
    ext.keep = {"a"}
    _create(sched, _pod("p", {"nvidia.com/gpu": "1"}))
    assert sched.schedule_pending()[0].node == "a"
    assert ext.verbs() == ["filter", "bind"]


def test_bound_pods_count_against_allocatable(env: Any) -> None:
    api, _ext, sched = env
    api.put_object(_node("a", 1))
    _create(sched, _pod("p1", {"nvidia.com/gpu": "1"}))
    _create(sched, _pod("p2", {"nvidia.com/gpu": "1"}))
    results = {r.pod: r for r in sched.schedule_pending()}
    assert results["default/p1"].node == "a"
    assert results["default/p2"].node is None
    assert results["default/p2"].message == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."


def test_plain_pod_is_bound_by_the_default_binder(env: Any) -> None:
    api, ext, sched = env
    api.put_object(_node("a", 0))
    _create(sched, _pod("web", {"cpu": "1"}))
    [r] = sched.schedule_pending()
    assert r.node == "a" and ext.calls == []
    assert api.get_object("pods", "web", namespace="default")["spec"]["nodeName"] == "a"


def test_node_selector_and_required_affinity_filter_nodes(env: Any) -> None:
    api, ext, sched = env
    api.put_object(_node("a", 1, {"gpu.product": "T4"}))
    api.put_object(_node("b", 1, {"gpu.product": "A100"}))
    _create(sched, _pod("sel", {"nvidia.com/gpu": "1"}, nodeSelector={"gpu.product": "A100"}))
    assert sched.schedule_pending()[0].node == "b"
    assert json.loads(ext.calls[0][1])["NodeNames"] == ["b"]
    _create(sched, _pod("nowhere", {"nvidia.com/gpu": "1"}, nodeSelector={"gpu.product": "H100"}))
    [r] = sched.schedule_pending()
    assert r.node is None and "didn't match Pod's node affinity/selector" in r.message


@pytest.mark.parametrize("expr, matches", [
    ({"key": "gpu.product", "operator": "In", "values": ["T4", "L4"]}, True),
    ({"key": "gpu.product", "operator": "NotIn", "values": ["T4"]}, False),
    ({"key": "gpu.product", "operator": "Exists"}, True),
    ({"key": "zone", "operator": "DoesNotExist"}, True),
    ({"key": "gpu.count", "operator": "Gt", "values": ["2"]}, True),
    ({"key": "gpu.count", "operator": "Lt", "values": ["2"]}, False),
    ({"key": "gpu.product", "operator": "Gt", "values": ["2"]}, False),  # not a number: no match
    ({"key": "gpu.product", "operator": "Sometimes"}, False),
])
def test_node_affinity_operators(expr: dict[str, Any], matches: bool) -> None:
    node = {"metadata": {"labels": {"gpu.product": "T4", "gpu.count": "4"}}}
    pod = {"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [expr]}]}}}}}
    assert (node_affinity_mismatch(pod, node) == "") is matches


def test_extender_error_is_a_result_not_an_exception(env: Any) -> None:
    api, ext, sched = env
    api.put_object(_node("a", 1))
    ext.fail_filter = True
    _create(sched, _pod("p", {"nvidia.com/gpu": "1"}))
    _create(sched, _pod("web", {"cpu": "1"}))
    results = {r.pod: r for r in sched.schedule_pending()}
    assert results["default/p"].node is None and "HTTP 500" in results["default/p"].message
    assert results["default/web"].node == "a"  # the pass went on


def test_scheduling_queue_backs_off_and_requeues_as_kube_scheduler_does() -> None:
    """Issue 24: bind failures back off 1 s doubling to 10 s; pods the extender left unschedulable move on any
    cluster event (after their back-off) or at the 5-minute flush, never otherwise."""
    from kubegpu_standins.scheduler import SchedulingQueue

    now = [0.0]
    q = SchedulingQueue(clock=lambda: now[0])
    q.add("d/a", "u-a")
    q.add("d/b", "u-b")
    assert [q.backoff_s(n) for n in (1, 2, 3, 4, 5, 6)] == [1, 2, 4, 8, 10, 10]
    a = q.pop()
    assert a is not None and a.key == "d/a" and a.attempts == 1
    q.bind_failed("d/a")
    b = q.pop()
    assert b is not None and b.key == "d/b"
    q.unschedulable("d/b")
    assert q.pop() is None  # a backs off 1 s; b waits for an event
    now[0] = 1.0
    a = q.pop()
    assert a is not None and a.key == "d/a" and a.attempts == 2
    q.bind_failed("d/a")
    now[0] = 2.5
    assert q.pop() is None  # 2 s since its second attempt
    q.cluster_event()  # b's back-off (1 s) has passed: straight to the active queue
    b = q.pop()
    assert b is not None and b.key == "d/b" and b.attempts == 2
    q.unschedulable("d/b")
    now[0] = 3.0
    a = q.pop()
    assert a is not None and a.key == "d/a"
    q.forget("d/a")  # bound
    q.pod_updated("d/b")  # its own update, 0.5 s into a 2 s back-off: back-off queue
    assert q.pop() is None
    now[0] = 4.5
    assert q.pop() is not None
    q.unschedulable("d/b")
    now[0] = 4.5 + 299
    assert q.pop() is None
    now[0] = 4.5 + 300  # the flush
    assert q.pop() is not None and q.flushed == 1


def test_scheduling_queue_keeps_the_events_that_arrive_while_a_pod_is_being_scheduled() -> None:
    """A pod deleted (its GPUs freed) while another pod's filter is on its way: that pod, refused by every node,
    is requeued at once as kube-scheduler does (its in-flight events, determineSchedulingHintForInFlightPod),
    not parked until an event that may never come or the 5-minute flush."""
    from kubegpu_standins.scheduler import SchedulingQueue

    now = [0.0]
    q = SchedulingQueue(clock=lambda: now[0])
    q.add("d/a", "u-a")
    q.add("d/b", "u-b")
    a = q.pop()
    assert a is not None
    q.cluster_event()  # while a is being scheduled
    q.unschedulable("d/a")
    assert q.requeued_by_event == 1
    now[0] = 1.0  # a's back-off has passed: it is tried again, with no further event
    assert [q.pop().key, q.pop().key] == ["d/b", "d/a"]  # type: ignore[union-attr]
    q.unschedulable("d/b")  # no event during b's attempt: parked
    q.pod_updated("d/a")  # a's own update while a is in flight
    q.unschedulable("d/a")
    now[0] = 10.0
    b_or_a = q.pop()
    assert b_or_a is not None and b_or_a.key == "d/a" and q.pop() is None  # b waits for an event


def test_scheduling_queue_backs_off_a_pod_whose_extender_erred() -> None:
    """An extender that is down or answers Error fails the cycle with an error: the pod is tried again after
    its back-off with no cluster event, not parked until the 5-minute flush (extender.go, schedule_one.go)."""
    from kubegpu_standins.scheduler import SchedulingQueue

    now = [0.0]
    q = SchedulingQueue(clock=lambda: now[0])
    q.add("d/a", "u-a")
    assert q.pop() is not None
    q.errored("d/a")
    assert q.pop() is None  # backing off 1 s
    now[0] = 1.0
    a = q.pop()
    assert a is not None and a.key == "d/a" and q.cycle_errors == 1 and q.flushed == 0
