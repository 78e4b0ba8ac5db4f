"""The handoff reads pods in their slim form (kubegpu.node.handoff.pods) and sees what it saw in full
lightkube models; its watch keeps a tombstone of each pod (no annotations), and a pod found gone at a
relist is still forgotten."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from kubegpu.kube.client import make_client
from kubegpu.kube.resources import Pod
from kubegpu.model import annotations as A
from kubegpu.model import resources as R
from kubegpu.model import signing
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.records import read_pod
from kubegpu.node.handoff import HandoffResolver, make_resolver
from kubegpu.node.handoff.entries import is_live_here, pod_view
from kubegpu.node.handoff.pods import HandoffPod, tombstone
from kubegpu_standins.apiserver import ApiServer
from kubegpu_standins.handoff_seams import pending_count

KEY = b"a-test-record-key-of-32-bytes-ok"
NODE = "n1"


def workload_pod(name: str, *, record: bool = True, phase: str = "Pending") -> dict[str, Any]:
    """A pod as the API server returns it: most of it (env, probes, mounts, status) the handoff never reads."""
    uid = f"uid-{name}"
    ann = {"kubectl.kubernetes.io/last-applied-configuration": "{" + "x" * 2000 + "}"}
    if record:
        value = encode(PodAllocation((ContainerAllocation("c0", (DeviceGrant(0, "GPU-aaaa", 25, 25 * 2**28, 25),)),)))
        ann[A.DEVICE_ALLOCATED] = value
        ann[signing.RECORD_SIGNATURE] = signing.sign(KEY, uid, NODE, value)
    probe = {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 10}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": uid, "resourceVersion": "7",
                     "creationTimestamp": "2026-11-24T01:00:00Z", "labels": {"app": "web"}, "annotations": ann,
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web",
                                          "uid": "rs-uid", "controller": True}],
                     "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
                                        "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}]},
        "spec": {"nodeName": NODE, "restartPolicy": "Always",
                 "initContainers": [{"name": "i0", "image": "init:1", "resources": {"limits": {R.NVIDIA_GPU: "1"}}}],
                 "containers": [{"name": "c0", "image": "web:1", "livenessProbe": probe,
                                 "env": [{"name": "A", "value": "1"}],
                                 "volumeMounts": [{"name": "v", "mountPath": "/v"}],
                                 "resources": {"limits": {R.GPU_CORE: "25", R.GPU_MEMORY_RATIO: "25",
                                                          R.GPU_SLOTS: "1", "cpu": "1"},
                                               "requests": {"cpu": "500m"}}}],
                 "volumes": [{"name": "v", "emptyDir": {}}]},
        "status": {"phase": phase, "hostIP": "10.0.0.1", "startTime": "2026-11-24T01:00:01Z",
                   "conditions": [{"type": "Ready", "status": "True",
                                   "lastTransitionTime": "2026-11-24T01:00:02Z"}],
                   "containerStatuses": [{"name": "c0", "ready": True, "restartCount": 0, "image": "web:1",
                                          "imageID": "web@sha256:00", "state": {"running": {}}}]},
    }


def slim(raw: dict[str, Any]) -> dict[str, Any]:
    # As lightkube decodes a HandoffPod list, watch or patch: from the response bytes.
    decoded: dict[str, Any] = msgspec.json.decode(json.dumps(raw).encode(), type=HandoffPod).to_dict()
    return decoded


def test_the_handoff_pod_reads_what_the_full_model_reads() -> None:
    for raw in (workload_pod("p1"), workload_pod("p2", record=False), workload_pod("p3", phase="Running"),
                workload_pod("p4", phase="Succeeded")):
        full = Pod.from_dict(raw).to_dict()
        assert pod_view(slim(raw), 1, KEY) == pod_view(full, 1, KEY)
        assert is_live_here(slim(raw), NODE) == is_live_here(full, NODE)
    view = pod_view(slim(workload_pod("p1")), 1, KEY)
    assert [e.container for e in view.entries] == ["c0"] and not view.forged
    assert view.created == "2026-11-24T01:00:00Z"


def test_the_watch_keeps_only_a_tombstone_and_a_pod_found_gone_is_forgotten() -> None:
    pod = msgspec.json.decode(json.dumps(workload_pod("p1")).encode(), type=HandoffPod)
    kept = tombstone(pod)
    full = pod.to_dict()
    assert kept.to_dict() == {"metadata": {"name": "p1", "namespace": "default", "uid": "uid-p1",
                                           "resourceVersion": "7"},
                              "spec": full["spec"], "status": full["status"]}  # no annotations, no record
    resolver = HandoffResolver(NODE, key=KEY)
    resolver.observe(pod.to_dict())
    assert pending_count(resolver, R.GPU_SLOTS, 1) == 1
    resolver.observe(kept.to_dict(), deleted=True)  # what a relist hands over for a pod no longer listed
    assert pending_count(resolver, R.GPU_SLOTS, 1) == 0
    resolver.observe(pod.to_dict())  # and a lagging watch never brings it back
    assert pending_count(resolver, R.GPU_SLOTS, 1) == 0


def test_the_resolver_watch_caches_tombstones_and_serves_from_slim_pods() -> None:
    with ApiServer() as api:
        tmp = Path(tempfile.mkdtemp(prefix="kgh-"))
        plain = workload_pod("p2", record=False)  # no GPU: the watch sees every pod on its node
        plain["spec"].pop("initContainers")
        plain["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
        for pod in (workload_pod("p1"), plain):
            api.put_object(pod)
        resolver = make_resolver(make_client(api.write_kubeconfig(tmp / "kubeconfig")), NODE,
                                 pod_resources_socket=str(tmp / "pr.sock"), key=KEY)
        try:
            assert resolver.watch is not None and resolver.watch.informer is not None
            cache = resolver.watch.informer.cache
            assert sorted(cache) == ["default/p1", "default/p2"]
            assert all(set(p.to_dict()["metadata"]) == {"name", "namespace", "uid", "resourceVersion"}
                       and set(p.to_dict()["spec"]["containers"][0]) == {"name", "resources"} for p in cache.values())
            assert pending_count(resolver, R.GPU_SLOTS, 1) == 1
            assert resolver.consistent_read() and pending_count(resolver, R.GPU_SLOTS, 1) == 1
            # Served, and acknowledged through a patch whose answer decodes as a HandoffPod.
            got = resolver.resolve(R.GPU_SLOTS, ["GPU-aaaa::3"])
            assert got is not None and got.pod == "default/p1"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and A.DEVICE_ASSIGNED not in (
                    api.get_object("pods", "p1", "default")["metadata"].get("annotations") or {}):
                time.sleep(0.05)
            ann = api.get_object("pods", "p1", "default")["metadata"]["annotations"]
            assert read_pod({"metadata": {"uid": "uid-p1", "annotations": ann}, "spec": {"nodeName": NODE}},
                            KEY).acks["c0"].devices == ("GPU-aaaa::3",)
        finally:
            resolver.close()


def test_a_relist_deletion_of_a_tombstone_counts_as_the_full_pod_did() -> None:
    """A GPU pod seen failed (this view forgot it), then deleted while the watch was down: the relist hands
    over the watch cache's tombstone, and the node publishes that its view has seen up to the LIST's version,
    as it did when the cache held the full pod."""
    from kubegpu.kube.informer import EventType, WatchEvent

    failed = workload_pod("f1", phase="Failed")
    seen = []
    for kept in (Pod.from_dict(failed), tombstone(msgspec.json.decode(json.dumps(failed).encode(),
                                                                       type=HandoffPod))):
        r = HandoffResolver(NODE, key=KEY)
        r.observe(workload_pod("f1"))
        r.observe(failed)
        r.on_event(WatchEvent(EventType.DELETED, kept, kept, version="40"))
        seen.append(r._seen)
    assert seen == [40, 40]
