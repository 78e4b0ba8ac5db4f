"""The extender's side of the handoff, on its ``ClusterView``: signed records only, Kubernetes'
init-container rule, acknowledged GPUs of pods it did not place, collisions held, one waiting pod per
(resource, count) and node."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.records import Ack, encode_acks
from kubegpu.scheduler.limits import Limits, bounded_filter, fitted_node_by_node
from kubegpu.scheduler.plan import PlanSettings, PodPlan, plan_pod
from kubegpu.scheduler.state import ClusterView
from kubegpu.scheduler.verbs import FilterOutcome

KEY = b"extender-test-key-0123456789abcd"


def plan_of(pod: dict[str, Any], **settings: Any) -> PodPlan:
    return plan_pod(pod, PlanSettings(**settings))


def observe(view: ClusterView, pod: dict[str, Any], deleted: bool = False, version: str = "") -> None:
    view.ledger.observe_pod(pod, plan_of(pod), deleted, version)


def blocked(view: ClusterView, pod: dict[str, Any]) -> dict[str, str]:
    plan = plan_of(pod)
    return view.handoffs.blocked(plan.key, plan.shapes)


def filter_(view: ClusterView, pod: dict[str, Any], names: list[str]) -> FilterOutcome:
    plan = plan_of(pod)
    if not fitted_node_by_node(plan):
        return view.filter(plan, names)
    return asyncio.run(bounded_filter(view, plan, names, Limits(filter_budget_s=3600)))


@pytest.fixture
def view(monkeypatch: pytest.MonkeyPatch) -> ClusterView:
    monkeypatch.delenv("KUBEGPU_HANDOFF_WAIT", raising=False)
    v = ClusterView(record_key=KEY)
    v.set_inventory("n", FakeBackend("t4x4", node_name="n").discover())
    return v


def spec_pod(name: str, limits: dict[str, str], alloc: PodAllocation | None = None, *, acks: dict | None = None,
             init: dict[str, str] | None = None, sign: bool = True) -> dict[str, Any]:
    ann: dict[str, str] = {}
    if alloc is not None:
        value = encode(alloc)
        ann[A.DEVICE_ALLOCATED] = value
        if sign:
            ann[signing.RECORD_SIGNATURE] = signing.sign(KEY, name, "n", value)
    if acks is not None:
        value = encode_acks(acks)
        ann[A.DEVICE_ASSIGNED] = value
        ann[signing.ACK_SIGNATURE] = signing.sign(KEY, name, "n", value, kind="ack")
    spec: dict[str, Any] = {"nodeName": "n", "containers": [{"name": "c", "resources": {"limits": limits}}]}
    if init:
        spec["initContainers"] = [{"name": "i", "resources": {"limits": init}}]
    return {"metadata": {"name": name, "namespace": "d", "uid": name, "annotations": ann}, "spec": spec,
            "status": {"phase": "Running"}}


def share(view: ClusterView, j: int, core: int) -> DeviceGrant:
    g = view.nodes["n"].inventory.gpus[j]  # type: ignore[union-attr]
    return DeviceGrant(g.minor, g.uuid, core, g.memory_bytes * core // 100, core)


def test_records_count_by_the_init_rule_and_forged_ones_not_at_all(view: ClusterView) -> None:
    st = view.nodes["n"].state
    a = share(view, 0, 80)
    init = PodAllocation((ContainerAllocation("i", (a,), init=True), ContainerAllocation("c", (share(view, 0, 20),))))
    observe(view, spec_pod("p", {R.GPU_CORE: "20", R.GPU_MEMORY_RATIO: "20", R.GPU_SLOTS: "1"}, init,
                              init={R.GPU_CORE: "80", R.GPU_MEMORY_RATIO: "80", R.GPU_SLOTS: "1"}))
    assert st.core_free(a.uuid) == 20  # 100 - max(80, 20)
    forged = PodAllocation((ContainerAllocation("c", tuple(share(view, j, 100) for j in range(4))),))
    observe(view, spec_pod("f", {R.NVIDIA_GPU: "4"}, forged, sign=False))
    assert view.ledger.forged == 1 and ("d/f" not in view.ledger.held or view.ledger.held["d/f"].alloc.grants() == ())
    assert st.core_free(view.nodes["n"].inventory.gpus[1].uuid) == 100  # type: ignore[union-attr]


def test_acknowledged_default_scheduler_pods_are_held(view: ClusterView) -> None:
    g = share(view, 2, 100)
    observe(view, spec_pod("plain", {R.NVIDIA_GPU: "1"}, acks={"c": Ack(R.NVIDIA_GPU, (g.uuid,), (g,))}))
    assert view.nodes["n"].state.core_free(g.uuid) == 0
    out = filter_(view, spec_pod("s", {R.GPU_CORE: "10", R.GPU_MEMORY_RATIO: "10", R.GPU_SLOTS: "1"}), ["n"])
    assert out.passed == ["n"]  # another GPU, not GPU 2
    alloc, _ = view.choose(plan_of(spec_pod("s", {R.GPU_CORE: "10", R.GPU_MEMORY_RATIO: "10", R.GPU_SLOTS: "1"})), "n")
    assert alloc is not None and g.uuid not in {x.uuid for x in alloc.grants()}


def test_one_waiting_pod_per_resource_and_count_on_a_node(view: ClusterView) -> None:
    """Issue 24: the rule is checked at bind (serialized), not at filter (kube-scheduler filters the next pod
    before the previous bind arrives); the wait ends with the acknowledgement, or once the pod runs."""

    one = {R.NVIDIA_GPU: "1"}
    rec = PodAllocation((ContainerAllocation("c", (share(view, 0, 100),)),))
    waiting = spec_pod("w", one, rec)
    waiting["status"] = {"phase": "Pending"}
    observe(view, waiting)
    x = spec_pod("x", one)
    assert filter_(view, x, ["n"]).passed == ["n"]  # filter does not guess
    assert "being handed to the kubelet" in blocked(view, x)["n"]
    y = spec_pod("y", {R.NVIDIA_GPU: "2"})
    assert blocked(view, y) == {}  # another count: the kubelet's calls tell them apart
    g = rec.grants()[0]
    acked = spec_pod("w", one, rec, acks={"c": Ack(R.NVIDIA_GPU, (g.uuid,), (g,))})
    acked["status"] = {"phase": "Pending"}
    observe(view, acked)  # served
    assert blocked(view, x) == {}
    observe(view, waiting)  # (a recreated view) waiting again, then running with no acknowledgement yet
    assert blocked(view, x)
    observe(view, spec_pod("w", one, rec))
    assert blocked(view, x) == {}


@pytest.mark.parametrize("how", ["deleted", "failed by its kubelet", "deleted, found by a relist"])
def test_a_pod_that_ended_while_waiting_holds_its_kind_until_its_node_has_seen_it_end(view: ClusterView,
                                                                                       how: str) -> None:
    """The deleted-pod window: a waiting pod ends before the kubelet admits it; the next pod of its kind must
    not be bound there while the node daemon's view (its watch behind) still shows the first one waiting,
    or its call would be served the first one's record. The node publishes how far its view has got
    (A.HANDOFF_SEEN); the ended pod keeps its kind waiting until that reaches its end."""
    from kubegpu.scheduler.service import node_handler

    one = {R.GPU_CORE: "40", R.GPU_MEMORY_RATIO: "40", R.GPU_SLOTS: "1"}
    rec = PodAllocation((ContainerAllocation("c", (share(view, 0, 40),)),))
    waiting = spec_pod("w", one, rec)
    waiting["status"] = {"phase": "Pending"}
    waiting["metadata"]["resourceVersion"] = "10"
    nodes = node_handler(view)

    def node_event(seen: str | None) -> None:
        from lightkube.models.meta_v1 import ObjectMeta

        from kubegpu.kube.informer import EventType, WatchEvent
        from kubegpu.kube.resources import Node

        ann = {A.HANDOFF_SEEN: seen} if seen is not None else None
        nodes(WatchEvent(EventType.MODIFIED, Node(metadata=ObjectMeta(name="n", annotations=ann))))

    node_event("9")
    observe(view, waiting)
    nxt = spec_pod("next", one)
    assert "being handed" in blocked(view, nxt)["n"]
    if how == "deleted":
        gone = dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="12"))
        observe(view, gone, deleted=True)
    elif how == "failed by its kubelet":
        observe(view, dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="12"),
                              status={"phase": "Failed"}))
    else:
        observe(view, waiting, deleted=True, version="12")  # the last version held; the LIST's is 12
    assert view.nodes["n"].state.core_free(rec.grants()[0].uuid) == 100  # type: ignore[union-attr]  # GPUs freed
    why = blocked(view, nxt)["n"]
    assert "d/w ended before its node's daemon served it" in why
    other_kind = spec_pod("whole", {R.NVIDIA_GPU: "1"})
    assert blocked(view, other_kind) == {}
    node_event("11")  # the daemon's view: not there yet
    assert blocked(view, nxt)
    node_event("12")
    assert blocked(view, nxt) == {}
    assert view.handoffs.pending.get("n", {}) == {} and view.handoffs.ended == {}


def test_an_ended_pod_waits_for_nothing_on_a_node_that_does_not_publish_or_has_seen_further(
        view: ClusterView) -> None:

    one = {R.NVIDIA_GPU: "1"}
    rec = PodAllocation((ContainerAllocation("c", (share(view, 0, 100),)),))
    waiting = spec_pod("w", one, rec)
    waiting["status"] = {"phase": "Pending"}
    waiting["metadata"]["resourceVersion"] = "10"
    nxt = spec_pod("next", one)
    observe(view, waiting)
    observe(view, dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="12")), deleted=True)
    assert blocked(view, nxt) == {}  # no kubegpu daemon publishing: as before
    view.handoffs.node_progress("n", "15")  # a daemon whose view is already past the end
    observe(view, waiting)
    observe(view, dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="14")), deleted=True)
    assert blocked(view, nxt) == {}
    observe(view, waiting)
    observe(view, dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="16")), deleted=True)
    assert blocked(view, nxt)
    view.handoffs.node_progress("n", "15x")  # not a version (a hand-edited annotation): as if not published
    assert blocked(view, nxt) == {}
    view.handoffs.node_progress("n", "15")
    observe(view, waiting)
    observe(view, dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="16")), deleted=True)
    assert blocked(view, nxt)
    view.remove_node("n")  # the Node gone: nothing will ever be seen there
    assert blocked(view, nxt) == {}
