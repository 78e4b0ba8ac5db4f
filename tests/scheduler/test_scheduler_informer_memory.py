"""Issue 23: the extender's informers keep tombstones, not full objects (most of its memory at scale): a
pod, node or Device object deleted while the watch was down (seen only at the next relist, delivered with
what the cache kept) still leaves the view as a full object would."""

from __future__ import annotations

from typing import Any

import msgspec
from sched_harness import plan_of

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube.informer import EventType, WatchEvent
from kubegpu.kube.resources import Device, Node
from kubegpu.kube.slim import SlimPod
from kubegpu.model import annotations as A
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.device_object import device_object
from kubegpu.scheduler.service import device_handler, node_handler, pod_handler, tombstone
from kubegpu.scheduler.state import ClusterView


def gpu_pod(inv: Any) -> dict[str, Any]:
    gpu = inv.gpus[0]
    alloc = PodAllocation((ContainerAllocation("main", (DeviceGrant(gpu.minor, gpu.uuid, 100, gpu.memory_bytes,
                                                                                100),)),))
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "resourceVersion": "9",
                         "annotations": {A.DEVICE_ALLOCATED: encode(alloc), "other": "x" * 1000}},
            "spec": {"nodeName": "n0", "containers": [{"name": "main", "image": "cuda", "resources": {
                "limits": {"nvidia.com/gpu": "1"}}}]},
            "status": {"phase": "Running"}}


def test_deleted_objects_leave_the_view_from_their_tombstones() -> None:
    view = ClusterView(handoff_wait=False)
    inv = FakeBackend("dgx-a100", node_name="n0").discover()
    node = Node.from_dict({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": "n0", "resourceVersion": "3", "labels": {"a": "b"}}})
    device = Device.from_dict({**device_object(inv), "metadata": {"name": "n0", "resourceVersion": "4"}})
    pod = msgspec.convert(gpu_pod(inv), SlimPod)  # as the pod watch decodes it
    handlers = (node_handler(view), device_handler(view), pod_handler(view, plan_of))
    for handler, obj in zip(handlers, (node, device, pod), strict=True):
        handler(WatchEvent(EventType.ADDED, obj))
    assert "ns/p" in view.ledger.held and view.nodes["n0"].state is not None and view.nodes["n0"].labels

    kept = [tombstone(o) for o in (pod, device, node)]
    assert all(len(str(k.to_dict())) < len(str(o.to_dict())) for k, o in zip(kept, (pod, device, node),
                                                                               strict=True))
    assert [k.metadata.resourceVersion for k in kept] == ["9", "4", "3"]
    for handler, obj in zip(reversed(handlers), kept, strict=True):
        handler(WatchEvent(EventType.DELETED, obj, obj))
    assert "ns/p" not in view.ledger.held
    assert view.nodes["n0"].state is None and not view.nodes["n0"].labels
