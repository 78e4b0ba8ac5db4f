"""The extender's side of the handoff, on its ``ClusterView``: signed records only, Kubernetes'
init-container rule, acknowledged GPUs of pods it did not place, collisions held, one waiting pod per
(resource, count) and node."""

from __future__ import annotations

from typing import Any

import pytest

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.records import Ack, encode_acks
from kubegpu.scheduler.state import ClusterView

KEY = b"extender-test-key-0123456789abcd"


@pytest.fixture
def view(monkeypatch: pytest.MonkeyPatch) -> ClusterView:
    monkeypatch.setenv(signing.KEY_ENV, KEY.decode())
    monkeypatch.delenv("KUBEGPU_HANDOFF_WAIT", raising=False)
    v = ClusterView()
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
    view.observe_pod(spec_pod("p", {R.GPU_CORE: "20", R.GPU_MEMORY_RATIO: "20", R.GPU_SLOTS: "1"}, init,
                              init={R.GPU_CORE: "80", R.GPU_MEMORY_RATIO: "80", R.GPU_SLOTS: "1"}))
    assert st.core_free(a.uuid) == 20  # 100 - max(80, 20)
    forged = PodAllocation((ContainerAllocation("c", tuple(share(view, j, 100) for j in range(4))),))
    view.observe_pod(spec_pod("f", {R.NVIDIA_GPU: "4"}, forged, sign=False))
    assert view.forged == 1 and ("d/f" not in view.held or view.held["d/f"].alloc.grants() == ())
    assert st.core_free(view.nodes["n"].inventory.gpus[1].uuid) == 100  # type: ignore[union-attr]


def test_acknowledged_default_scheduler_pods_are_held(view: ClusterView) -> None:
    g = share(view, 2, 100)
    view.observe_pod(spec_pod("plain", {R.NVIDIA_GPU: "1"}, acks={"c": Ack(R.NVIDIA_GPU, (g.uuid,), (g,))}))
    assert view.nodes["n"].state.core_free(g.uuid) == 0
    out = view.filter(spec_pod("s", {R.GPU_CORE: "10", R.GPU_MEMORY_RATIO: "10", R.GPU_SLOTS: "1"}), ["n"], "kubegpu")
    assert out.passed == ["n"]  # another GPU, not GPU 2
    alloc, _ = view.choose(spec_pod("s", {R.GPU_CORE: "10", R.GPU_MEMORY_RATIO: "10", R.GPU_SLOTS: "1"}),
                           "n", "kubegpu")
    assert alloc is not None and g.uuid not in {x.uuid for x in alloc.grants()}


def test_one_waiting_pod_per_resource_and_count_on_a_node(view: ClusterView) -> None:
    """Issue 24: the rule is checked at bind (serialized), not at filter (kube-scheduler filters the next pod
    before the previous bind arrives); the wait ends with the acknowledgement, or once the pod runs."""
    from kubegpu.model.request import parse_pod

    one = {R.NVIDIA_GPU: "1"}
    rec = PodAllocation((ContainerAllocation("c", (share(view, 0, 100),)),))
    waiting = spec_pod("w", one, rec)
    waiting["status"] = {"phase": "Pending"}
    view.observe_pod(waiting)
    x = spec_pod("x", one)
    assert view.filter(x, ["n"], "kubegpu").passed == ["n"]  # filter does not guess
    assert "being handed to the kubelet" in view.ledger.handoff_blocked(x, parse_pod(x))["n"]
    y = spec_pod("y", {R.NVIDIA_GPU: "2"})
    assert view.ledger.handoff_blocked(y, parse_pod(y)) == {}  # another count: the kubelet's calls tell them apart
    g = rec.grants()[0]
    acked = spec_pod("w", one, rec, acks={"c": Ack(R.NVIDIA_GPU, (g.uuid,), (g,))})
    acked["status"] = {"phase": "Pending"}
    view.observe_pod(acked)  # served
    assert view.ledger.handoff_blocked(x, parse_pod(x)) == {}
    view.observe_pod(waiting)  # (a recreated view) waiting again, then running with no acknowledgement yet
    assert view.ledger.handoff_blocked(x, parse_pod(x))
    view.observe_pod(spec_pod("w", one, rec))
    assert view.ledger.handoff_blocked(x, parse_pod(x)) == {}


@pytest.mark.parametrize("how", ["deleted", "failed by its kubelet", "deleted, found by a relist"])
def test_a_pod_that_ended_while_waiting_holds_its_kind_until_its_node_has_seen_it_end(view: ClusterView,
                                                                                       how: str) -> None:
    """The deleted-pod window: a waiting pod ends before the kubelet admits it; the next pod of its kind must
    not be bound there while the node daemon's view (its watch behind) still shows the first one waiting,
    or its call would be served the first one's record. The node publishes how far its view has got
    (A.HANDOFF_SEEN); the ended pod keeps its kind waiting until that reaches its end."""
    from kubegpu.model.request import parse_pod
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
    view.observe_pod(waiting)
    nxt = spec_pod("next", one)
    assert "being handed" in view.ledger.handoff_blocked(nxt, parse_pod(nxt))["n"]
    if how == "deleted":
        gone = dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="12"))
        view.observe_pod(gone, deleted=True)
    elif how == "failed by its kubelet":
        view.observe_pod(dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="12"),
                              status={"phase": "Failed"}))
    else:
        view.observe_pod(waiting, deleted=True, version="12")  # the last version held; the LIST's is 12
    assert view.nodes["n"].state.core_free(rec.grants()[0].uuid) == 100  # type: ignore[union-attr]  # GPUs freed
    why = view.ledger.handoff_blocked(nxt, parse_pod(nxt))["n"]
    assert "d/w ended before its node's daemon served it" in why
    other_kind = spec_pod("whole", {R.NVIDIA_GPU: "1"})
    assert view.ledger.handoff_blocked(other_kind, parse_pod(other_kind)) == {}
    node_event("11")  # the daemon's view: not there yet
    assert view.ledger.handoff_blocked(nxt, parse_pod(nxt))
    node_event("12")
    assert view.ledger.handoff_blocked(nxt, parse_pod(nxt)) == {}
    assert view.ledger.pending.get("n", {}) == {} and view.ledger.ended == {}


def test_an_ended_pod_waits_for_nothing_on_a_node_that_does_not_publish_or_has_seen_further(
        view: ClusterView) -> None:
    from kubegpu.model.request import parse_pod

    one = {R.NVIDIA_GPU: "1"}
    rec = PodAllocation((ContainerAllocation("c", (share(view, 0, 100),)),))
    waiting = spec_pod("w", one, rec)
    waiting["status"] = {"phase": "Pending"}
    waiting["metadata"]["resourceVersion"] = "10"
    nxt = spec_pod("next", one)
    view.observe_pod(waiting)
    view.observe_pod(dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="12")), deleted=True)
    assert view.ledger.handoff_blocked(nxt, parse_pod(nxt)) == {}  # no kubegpu daemon publishing: as before
    view.ledger.node_progress("n", "15")  # a daemon whose view is already past the end
    view.observe_pod(waiting)
    view.observe_pod(dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="14")), deleted=True)
    assert view.ledger.handoff_blocked(nxt, parse_pod(nxt)) == {}
    view.observe_pod(waiting)
    view.observe_pod(dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="16")), deleted=True)
    assert view.ledger.handoff_blocked(nxt, parse_pod(nxt))
    view.ledger.node_progress("n", "15x")  # not a version (a hand-edited annotation): as if not published
    assert view.ledger.handoff_blocked(nxt, parse_pod(nxt)) == {}
    view.ledger.node_progress("n", "15")
    view.observe_pod(waiting)
    view.observe_pod(dict(waiting, metadata=dict(waiting["metadata"], resourceVersion="16")), deleted=True)
    assert view.ledger.handoff_blocked(nxt, parse_pod(nxt))
    view.remove_node("n")  # the Node gone: nothing will ever be seen there
    assert view.ledger.handoff_blocked(nxt, parse_pod(nxt)) == {}
