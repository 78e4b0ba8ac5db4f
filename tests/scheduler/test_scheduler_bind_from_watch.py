"""Issue 23: bind reads the pending pod from the pod watch instead of a GET, and that never changes an answer.

The watch's copy is bound only at the resourceVersion it was copied at (the Binding's precondition), a refusal
is answered only from the API server's pod, and a pod the watch has not shown (or not kept) is read with a
GET: whatever the watch's lag, the outcome is the one a GET would have given. The lag is made here by putting
an older copy back into the extender's cache, as a watch that has not delivered the newer version yet would
have it."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import msgspec
import pytest
from polling import until
from sched_harness import Cluster, fixture_pod, mark_running, pod_yaml, start_cluster
from test_scheduler_behaviour import pod, share

from kubegpu.kube.slim import SlimPod
from kubegpu.model import annotations as A
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, decode, encode
from kubegpu.model.limits import count_gpu_containers
from kubegpu.model.request import parse_pod
from kubegpu.model.signing import record_annotations
from kubegpu.scheduler.pending import PendingPods, kept_for_bind, read_at_bind
from kubegpu.scheduler.plan import PlanSettings, follows_its_node, plan_pod, pod_policies
from kubegpu.scheduler.service import kept_pod


def _cache(cluster: Cluster) -> dict[str, Any]:
    assert cluster.ext.service is not None
    return cluster.ext.service.pending._cache  # type: ignore[return-value]


def _copy(cluster: Cluster, key: str) -> SlimPod | None:
    return cluster.ext.call(lambda: _cache(cluster).get(key))


def _version_of(cluster: Cluster, name: str) -> str:
    return str(cluster.api.get_object("pods", name, "default")["metadata"]["resourceVersion"])


def _put_and_watch(cluster: Cluster, p: dict[str, Any]) -> dict[str, Any]:
    """Create the pod and wait until the extender's watch holds its copy."""
    created = cluster.api.put_object(p)
    key = f"default/{p['metadata']['name']}"
    version = created["metadata"]["resourceVersion"]
    assert until(lambda: (c := _copy(cluster, key)) is not None and c.metadata.resourceVersion == version)
    return created


def _edit(cluster: Cluster, name: str, annotations: dict[str, str]) -> None:
    """A user's UPDATE of a pending pod (the webhook lets anything but kubegpu's records change)."""
    def mutate(o: dict[str, Any]) -> dict[str, Any]:
        o["metadata"]["annotations"] = {**(o["metadata"].get("annotations") or {}), **annotations}
        o["metadata"].pop("resourceVersion", None)
        return o
    cluster.api.store.update(cluster.api.kind("pods"), "default", name, mutate)
    version = _version_of(cluster, name)
    assert until(lambda: (c := _copy(cluster, f"default/{name}")) is not None
                  and c.metadata.resourceVersion == version)


def _lag(cluster: Cluster, key: str, older: SlimPod) -> None:
    """Put an older copy back, as a watch that has not delivered the pod's latest version yet holds it."""
    cluster.ext.call(lambda: _cache(cluster).__setitem__(key, older))


def _bind(cluster: Cluster, name: str, uid: str, node: str) -> str:
    r = cluster.post("/bind", {"PodName": name, "PodNamespace": "default", "PodUID": uid, "Node": node})
    assert r.status_code == 200
    return str(r.json().get("Error", ""))


def _requests(cluster: Cluster, verb: str) -> int:
    return cluster.api.store.requests[verb]


def _record(cluster: Cluster, name: str) -> Any:
    p = cluster.api.get_object("pods", name, "default")
    value = (p["metadata"].get("annotations") or {}).get(A.DEVICE_ALLOCATED)
    return p["spec"].get("nodeName"), decode(value) if value else None


def test_bind_reads_the_watched_pod_with_no_get(cluster: Cluster) -> None:
    created = _put_and_watch(cluster, pod("w", share(30, ratio=30)))
    gets = _requests(cluster, "GET pods")
    assert _bind(cluster, "w", created["metadata"]["uid"], "gpu-node-a") == ""
    assert _requests(cluster, "GET pods") == gets  # no read of the pod: the watch's copy was used
    node, alloc = _record(cluster, "w")
    assert node == "gpu-node-a" and alloc is not None and alloc.grants()[0].core == 30
    assert cluster.ext.call(lambda: cluster.view.ledger.held["default/w"].node) == "gpu-node-a"
    # Bound, it leaves the copies (its entry is the accounting's tombstone now).
    assert until(lambda: cluster.ext.call(lambda: cluster.ext.service.pending.get("default/w")) is None)


def test_a_pod_the_watch_has_not_shown_is_read_with_a_get(cluster: Cluster) -> None:
    created = _put_and_watch(cluster, pod("g", {"nvidia.com/gpu": "1"}))
    cluster.ext.call(lambda: _cache(cluster).pop("default/g"))  # the watch behind: no copy yet
    gets = _requests(cluster, "GET pods")
    assert _bind(cluster, "g", created["metadata"]["uid"], "gpu-node-b") == ""
    assert _requests(cluster, "GET pods") == gets + 1
    assert _record(cluster, "g")[0] == "gpu-node-b"


def test_a_copy_older_than_the_pod_is_never_bound(cluster: Cluster) -> None:
    """The copy allows any GPU model; the pod now asks for an A100: bound to the H100 node from the copy, the
    Binding's resourceVersion precondition refuses it, and the API server's pod is refused for its model."""
    created = _put_and_watch(cluster, pod("m", {"nvidia.com/gpu": "1"}))
    older = _copy(cluster, "default/m")
    assert older is not None
    _edit(cluster, "m", {A.GPU_MODEL: "A100"})
    _lag(cluster, "default/m", older)
    bindings = _requests(cluster, "POST pods/binding")
    err = _bind(cluster, "m", created["metadata"]["uid"], "gpu-node-b")
    assert "GPU model not in the allowed A100" in err
    assert _requests(cluster, "POST pods/binding") == bindings + 1  # the copy's Binding, refused (409)
    assert _record(cluster, "m") == (None, None)
    assert cluster.ext.call(lambda: "default/m" not in cluster.view.ledger.held)


def test_a_refusal_is_answered_from_the_api_servers_pod_not_the_copy(cluster: Cluster) -> None:
    """The copy asks for an H100 only; the pod no longer does: bound to the A100 node, as the pod now asks."""
    created = _put_and_watch(cluster, pod("r", {"nvidia.com/gpu": "1"}, {A.GPU_MODEL: "H100"}))
    older = _copy(cluster, "default/r")
    assert older is not None
    _edit(cluster, "r", {A.GPU_MODEL: "A100|H100"})
    _lag(cluster, "default/r", older)
    assert _bind(cluster, "r", created["metadata"]["uid"], "gpu-node-a") == ""
    assert _record(cluster, "r")[0] == "gpu-node-a"


def test_a_copy_that_changed_only_elsewhere_binds_at_the_new_version(cluster: Cluster) -> None:
    """An edit that changes nothing bind reads (a label, another annotation) still changes the version: the
    Binding from the older copy is refused, and the pod is bound from the API server's pod in the same call."""
    created = _put_and_watch(cluster, pod("v", share(20, ratio=20)))
    older = _copy(cluster, "default/v")
    assert older is not None
    _edit(cluster, "v", {"team": "ml"})
    _lag(cluster, "default/v", older)
    bindings = _requests(cluster, "POST pods/binding")
    assert _bind(cluster, "v", created["metadata"]["uid"], "gpu-node-c") == ""
    assert _requests(cluster, "POST pods/binding") == bindings + 2
    assert _record(cluster, "v")[0] == "gpu-node-c"
    held = cluster.view.ledger.held
    assert cluster.ext.call(lambda: sorted(k for k, h in held.items() if h.node == "gpu-node-c")) == ["default/v"]


def test_a_pod_recreated_under_its_name(cluster: Cluster) -> None:
    """kube-scheduler names the UID it placed. The new pod is bound when it names the new one, whichever
    copy the watch holds; the old UID is refused as recreated, even while the watch still shows the old pod."""
    old = _put_and_watch(cluster, pod("x", {"nvidia.com/gpu": "1"}))
    old_copy = _copy(cluster, "default/x")
    assert old_copy is not None
    cluster.api.store.delete(cluster.api.kind("pods"), "default", "x")
    new = _put_and_watch(cluster, pod("x", {"nvidia.com/gpu": "1"}))
    assert new["metadata"]["uid"] != old["metadata"]["uid"]

    _lag(cluster, "default/x", old_copy)  # the watch still shows the old pod
    err = _bind(cluster, "x", old["metadata"]["uid"], "gpu-node-a")
    assert "recreated" in err and new["metadata"]["uid"] in err
    assert _record(cluster, "x") == (None, None)
    assert cluster.ext.call(lambda: "default/x" not in cluster.view.ledger.held)

    gets = _requests(cluster, "GET pods")
    assert _bind(cluster, "x", new["metadata"]["uid"], "gpu-node-a") == ""  # the copy's UID is not this one
    assert _requests(cluster, "GET pods") == gets + 1
    assert _record(cluster, "x")[0] == "gpu-node-a"
    assert cluster.ext.call(lambda: cluster.view.ledger.held["default/x"].uid) == new["metadata"]["uid"]


def test_a_pod_deleted_after_its_copy_is_a_lookup_failure(cluster: Cluster) -> None:
    created = _put_and_watch(cluster, pod("d", {"nvidia.com/gpu": "1"}))
    older = _copy(cluster, "default/d")
    assert older is not None
    cluster.api.store.delete(cluster.api.kind("pods"), "default", "d")
    assert until(lambda: _copy(cluster, "default/d") is None)
    _lag(cluster, "default/d", older)
    err = _bind(cluster, "d", created["metadata"]["uid"], "gpu-node-a")
    assert "cannot read pod default/d" in err
    assert cluster.ext.call(lambda: "default/d" not in cluster.view.ledger.held)


# --- what is kept of a pending pod --------------------------------------------------------------------------

def _slim(p: dict[str, Any]) -> SlimPod:
    return msgspec.json.decode(msgspec.json.encode(p), type=SlimPod)  # as the watch decodes it


def _pods() -> list[dict[str, Any]]:
    out = [fixture_pod(n) for n in ("gpu-frac-core50", "gpu-mem-8gi", "gpu-two-containers", "gpu-whole-2")]
    out += [pod_yaml(n) for n in ("gpu-frac-core50", "gpu-two-containers", "plain-nogpu")]
    extra = copy.deepcopy(out[0])
    extra["metadata"]["annotations"] = {
        A.GPU_MODEL: "A100|H100", A.GPU_POLICY: "spread", A.NODE_POLICY: "binpack", A.REQUIRE_NVLINK: "true",
        "scheduler.alpha.kubernetes.io/affinity": "{}", "kubernetes.io/config.mirror": "x",
        "kubectl.kubernetes.io/last-applied-configuration": "{" + "x" * 5000 + "}"}
    extra["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "u",
                                             "controller": True}]
    extra["spec"]["initContainers"] = [{"name": "init", "image": "x", "resources": {"limits": {
        "nvidia.com/gpu": "1", "cpu": "2"}}}]
    extra["spec"]["overhead"] = {"cpu": "250m", "memory": "64Mi"}
    return [*out, extra]


@pytest.mark.parametrize("full", _pods(), ids=lambda p: p["metadata"]["name"])
def test_what_bind_reads_of_the_kept_copy_is_what_it_reads_of_the_pod(full: dict[str, Any]) -> None:
    full = copy.deepcopy(full)
    full["metadata"].setdefault("uid", "u-1")
    full["metadata"]["resourceVersion"] = "7"
    full["spec"].pop("nodeName", None)
    kept = kept_for_bind(_slim(full))
    cache = PendingPods({"ns/p": kept})
    got = cache.get("ns/p")
    if kept.spec is None:  # asks for no extended resource: identity only, never answered from the copy
        assert got is None and count_gpu_containers(full) == 0
        return
    assert got is not None
    assert parse_pod(got) == parse_pod(full)
    assert pod_policies(got, "a", "b") == pod_policies(full, "a", "b")
    assert follows_its_node(got) == follows_its_node(full)
    assert count_gpu_containers(got) == count_gpu_containers(full)
    assert plan_pod(got, PlanSettings()) == plan_pod(full, PlanSettings())  # demand, NVLink, CPU, memory and all
    assert got["metadata"]["uid"] == full["metadata"]["uid"] and got["metadata"]["resourceVersion"] == "7"
    kept_keys = set(got["metadata"].get("annotations") or {})
    assert kept_keys == {k for k in full["metadata"].get("annotations") or {} if read_at_bind(k)}
    assert cache.get("ns/p", "another-uid") is None  # another UID: only a GET can tell which is current


def test_the_watch_keeps_a_bound_pods_tombstone_and_a_pending_pods_copy() -> None:
    pending = _slim({"metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": "3",
                                  "annotations": {"note": "x" * 1000}},
                     "spec": {"containers": [{"name": "c", "image": "i", "env": [{"name": "A", "value": "B"}],
                                              "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
                     "status": {"phase": "Pending"}})
    kept = kept_pod(pending)
    assert kept.spec is not None and kept.spec.containers and kept.metadata.annotations is None
    bound = copy.deepcopy(pending)
    bound.spec.nodeName = "n1"  # type: ignore[union-attr]
    tomb = kept_pod(bound)
    assert tomb.spec is not None and tomb.spec.nodeName == "n1" and tomb.spec.containers is None
    assert PendingPods({"ns/p": tomb}).get("ns/p") is None


def test_a_handoff_wait_run_out_is_answered_from_the_api_servers_pod(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy's wait runs out (a pod of its kind is being handed to the kubelet on the node): the answer is
    given after a GET, within the same deadline (no second wait), with the wait's reason."""
    monkeypatch.delenv("KUBEGPU_HANDOFF_WAIT", raising=False)  # as deployed: pods of one kind take turns
    monkeypatch.setenv("KUBEGPU_HANDOFF_WAIT_S", "0.2")
    api, ext = start_cluster(tmp_path)
    cluster = Cluster(api, ext)
    try:
        first = _put_and_watch(cluster, pod("a", share(20, ratio=20)))
        assert _bind(cluster, "a", first["metadata"]["uid"], "gpu-node-c") == ""  # waits for its handoff
        second = _put_and_watch(cluster, pod("b", share(20, ratio=20)))
        gets = _requests(cluster, "GET pods")
        err = _bind(cluster, "b", second["metadata"]["uid"], "gpu-node-c")
        assert "pod default/a is being handed to the kubelet" in err and "not its turn within 0.2 s" in err
        assert _requests(cluster, "GET pods") == gets + 1
        assert _record(cluster, "b") == (None, None)
    finally:
        ext.stop()
        api.stop()


def test_a_pod_bound_elsewhere_while_its_bind_waits_keeps_what_it_holds_there(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """While b's bind waits for its turn on node a, something else (another extender replica) binds b to node b
    with its record, and the watch shows it. b's bind is then refused as already bound, and what b holds on
    node b stays accounted: releasing it with the refused bind's own hold would free a GPU b uses."""
    monkeypatch.delenv("KUBEGPU_HANDOFF_WAIT", raising=False)  # as deployed: pods of one kind take turns
    monkeypatch.setenv("KUBEGPU_HANDOFF_WAIT_S", "10")
    api, ext = start_cluster(tmp_path)
    cluster = Cluster(api, ext)
    try:
        first = _put_and_watch(cluster, pod("a", {"nvidia.com/gpu": "1"}))
        assert _bind(cluster, "a", first["metadata"]["uid"], "gpu-node-a") == ""  # waits for its handoff
        second = _put_and_watch(cluster, pod("b", {"nvidia.com/gpu": "1"}))
        uid = second["metadata"]["uid"]
        answer: list[str] = []
        waiting = threading.Thread(target=lambda: answer.append(_bind(cluster, "b", uid, "gpu-node-a")))
        waiting.start()
        assert until(lambda: cluster.ext.call(lambda: cluster.view.handoffs.waiting_binds.get("gpu-node-a", 0)) == 1)

        gpu = cluster.ext.call(lambda: cluster.view.nodes["gpu-node-b"].inventory.gpus[0])
        grant = DeviceGrant(gpu.minor, gpu.uuid, 100, gpu.memory_bytes, 100)
        value = encode(PodAllocation((ContainerAllocation("c0", (grant,)),)))
        key = cluster.ext.call(lambda: cluster.view.ledger.record_key)
        api.store.bind("default", "b", {"target": {"kind": "Node", "name": "gpu-node-b"},
                                        "metadata": {"annotations": record_annotations(value, uid, "gpu-node-b", key)}})
        assert until(lambda: cluster.ext.call(
            lambda: (h := cluster.view.ledger.held.get("default/b")) is not None and h.node == "gpu-node-b"))

        mark_running(cluster, "a")  # a's containers started: its turn is over
        waiting.join(15)
        assert answer and "already bound to gpu-node-b" in answer[0]
        held = cluster.ext.call(lambda: cluster.view.ledger.held.get("default/b"))
        assert held is not None and held.node == "gpu-node-b" and held.alloc.grants()[0].uuid == gpu.uuid
        assert _record(cluster, "b")[0] == "gpu-node-b"
    finally:
        ext.stop()
        api.stop()
