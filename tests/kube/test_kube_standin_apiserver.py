"""The stand-in API server behaves like the real one where kubegpu depends on it, behind lightkube's own calls."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import msgspec
import pytest
from lightkube.core.exceptions import ApiError
from lightkube.types import PatchType

from kubegpu.kube import Device, Node, Pod, make_client
from kubegpu.kube.writes import bind_pod, emit_event
from kubegpu_standins.apiserver import ApiServer, json_patch, strategic_merge_patch


def _pod(name: str, node: str = "") -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "namespace": "default"}, "spec": spec}


def test_create_get_list_with_resource_versions_and_defaults(kubeconfig: Path) -> None:
    c = make_client(kubeconfig)
    created = c.create(Pod.from_dict(_pod("p1")))
    assert created.status.phase == "Pending"
    assert created.spec.containers[0].resources.requests == {"nvidia.com/gpu": "1"}  # defaulted from limits
    c.create(Pod.from_dict(_pod("p2")))
    listing = c.list(Pod, namespace="*")
    names = sorted(p.metadata.name for p in listing)
    assert names == ["p1", "p2"]
    assert int(listing.resourceVersion) >= int(created.metadata.resourceVersion) + 1
    with pytest.raises(ApiError) as e:
        c.create(Pod.from_dict(_pod("p1")))
    assert e.value.status.code == 409 and e.value.status.reason == "AlreadyExists"
    with pytest.raises(ApiError) as e:
        c.get(Pod, "nope", namespace="default")
    assert e.value.status.code == 404


def test_stale_update_is_409_and_fresh_update_wins(kubeconfig: Path) -> None:
    c = make_client(kubeconfig)
    c.create(Pod.from_dict(_pod("p1")))
    a = c.get(Pod, "p1", namespace="default")
    b = c.get(Pod, "p1", namespace="default")
    a.metadata.labels = {"who": "a"}
    c.replace(a)
    b.metadata.labels = {"who": "b"}
    with pytest.raises(ApiError) as e:
        c.replace(b)
    assert e.value.status.code == 409
    assert c.get(Pod, "p1", namespace="default").metadata.labels == {"who": "a"}
    # A patch carrying a stale resourceVersion is a precondition failure too.
    with pytest.raises(ApiError) as e:
        c.patch(Pod, "p1", {"metadata": {"resourceVersion": b.metadata.resourceVersion, "labels": {"x": "1"}}},
                namespace="default", patch_type=PatchType.MERGE)
    assert e.value.status.code == 409


def test_binding_sets_node_and_refuses_a_second_bind(kubeconfig: Path, apiserver: ApiServer) -> None:
    c = make_client(kubeconfig)
    pod = c.create(Pod.from_dict(_pod("p1")))
    with pytest.raises(ApiError) as e:
        bind_pod(c, "default", "p1", "not-the-uid", "n1")
    assert e.value.status.code == 409
    bind_pod(c, "default", "p1", pod.metadata.uid, "n1")
    assert c.get(Pod, "p1", namespace="default").spec.nodeName == "n1"
    with pytest.raises(ApiError) as e:
        bind_pod(c, "default", "p1", pod.metadata.uid, "n2")
    assert e.value.status.code == 409 and "already assigned" in e.value.status.message
    with pytest.raises(ApiError) as e:
        bind_pod(c, "default", "missing", None, "n1")
    assert e.value.status.code == 404
    # The Binding's annotations land on the pod in the same write.
    c.create(Pod.from_dict(_pod("p2")))
    from kubegpu.kube.writes import binding_object

    with contextlib.suppress(msgspec.ValidationError):
        c.create(binding_object("default", "p2", None, "n2", {"kubegpu.io/x": "1"}), name="p2", namespace="default")
    p2 = c.get(Pod, "p2", namespace="default")
    assert p2.spec.nodeName == "n2" and p2.metadata.annotations == {"kubegpu.io/x": "1"}
    # The real server answers a Binding with a 201 Status.
    r = httpx.post(f"{apiserver.url}/api/v1/namespaces/default/pods/p1/binding",
                   json={"target": {"kind": "Node", "name": "n1"}})
    assert r.status_code == 409 and r.headers["content-type"] == "application/json"


def test_patch_types_and_status_subresource(kubeconfig: Path) -> None:
    c = make_client(kubeconfig)
    c.create(Node.from_dict({"metadata": {"name": "n1", "labels": {"a": "1"}}, "status": {"capacity": {"cpu": "4"}}}))
    c.patch(Node, "n1", {"metadata": {"labels": {"b": "2"}}}, patch_type=PatchType.STRATEGIC)
    c.patch(Node, "n1", [{"op": "add", "path": "/metadata/labels/c", "value": "3"}], patch_type=PatchType.JSON)
    c.patch(Node, "n1", {"metadata": {"labels": {"a": None}}}, patch_type=PatchType.MERGE)
    assert c.get(Node, "n1").metadata.labels == {"b": "2", "c": "3"}
    # Status through the main endpoint is ignored; through /status it is applied (and nothing else).
    c.patch(Node, "n1", {"status": {"capacity": {"kubegpu.io/gpu-core": "800"}}}, patch_type=PatchType.MERGE)
    assert "kubegpu.io/gpu-core" not in c.get(Node, "n1").status.capacity
    c.patch(Node.Status, "n1", {"metadata": {"labels": {"z": "9"}},
                                "status": {"capacity": {"kubegpu.io/gpu-core": "800"}}}, patch_type=PatchType.MERGE)
    node = c.get(Node, "n1")
    assert node.status.capacity["kubegpu.io/gpu-core"] == "800" and node.status.capacity["cpu"] == "4"
    assert "z" not in node.metadata.labels


def test_strategic_merge_merges_lists_by_key_and_json_patch_ops() -> None:
    old = {"spec": {"containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}]}}
    new = strategic_merge_patch(old, {"spec": {"containers": [{"name": "b", "image": "3"}, {"name": "c"}]}})
    assert new["spec"]["containers"] == [{"name": "a", "image": "1"}, {"name": "b", "image": "3"}, {"name": "c"}]
    doc = json_patch({"a": [1, 2], "b": {"c": 1}}, [{"op": "remove", "path": "/a/0"},
                                                     {"op": "move", "from": "/b/c", "path": "/d"},
                                                     {"op": "test", "path": "/d", "value": 1}])
    assert doc == {"a": [2], "b": {}, "d": 1}


def test_device_custom_resource_and_events(kubeconfig: Path) -> None:
    c = make_client(kubeconfig)
    c.create(Device({"metadata": {"name": "n1"}, "spec": {"devices": [{"id": "GPU-1", "minor": 0}]}}))
    got = c.get(Device, "n1")
    assert got["spec"]["devices"][0]["id"] == "GPU-1" and got["kind"] == "Device"
    assert [d.metadata.name for d in c.list(Device)] == ["n1"]
    c.create(Pod.from_dict(_pod("p1")))
    emit_event(c, namespace="default", kind="Pod", name="p1", uid=None, reason="Tested", message="hello",
               type_="Warning")
    from kubegpu.kube import Event

    events = list(c.list(Event, namespace="default"))
    assert [(e.reason, e.message, e.type) for e in events] == [("Tested", "hello", "Warning")]


def test_bad_bodies_get_a_status_not_a_crash(apiserver: ApiServer) -> None:
    r = httpx.post(f"{apiserver.url}/api/v1/namespaces/default/pods", content=b"{not json")
    assert r.status_code == 400 and r.json()["kind"] == "Status"
    r = httpx.patch(f"{apiserver.url}/api/v1/nodes/x", content=b"{}",
                    headers={"content-type": "application/apply-patch+yaml"})
    assert r.status_code in (404, 415)
    r = httpx.get(f"{apiserver.url}/api/v1/widgets")
    assert r.status_code == 404


def _watch_lines(url: str, n: int, timeout: float = 5.0) -> list[dict]:
    out = []
    with httpx.stream("GET", url, timeout=timeout) as r:
        for line in r.iter_lines():
            if line:
                out.append(json.loads(line))
            if len(out) >= n:
                break
    return out


def test_watch_replays_from_version_bookmarks_selectors_and_410(apiserver: ApiServer, kubeconfig: Path) -> None:
    c = make_client(kubeconfig)
    first = c.create(Pod.from_dict(_pod("p1")))
    c.create(Pod.from_dict(_pod("p2")))
    bind_pod(c, "default", "p1", None, "n1")
    rv = first.metadata.resourceVersion
    events = _watch_lines(f"{apiserver.url}/api/v1/pods?watch=true&resourceVersion={rv}", 2)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "p2"), ("MODIFIED", "p1")]
    # A field selector on spec.nodeName: p1 entering the selection is an ADDED.
    sel = _watch_lines(f"{apiserver.url}/api/v1/pods?watch=true&resourceVersion={rv}"
                       "&fieldSelector=spec.nodeName%3Dn1", 1)
    assert sel[0]["type"] == "ADDED" and sel[0]["object"]["metadata"]["name"] == "p1"
    bm = _watch_lines(f"{apiserver.url}/api/v1/nodes?watch=true&allowWatchBookmarks=true", 1)
    assert bm[0]["type"] == "BOOKMARK" and int(bm[0]["object"]["metadata"]["resourceVersion"]) >= 3
    apiserver.compact()
    gone = _watch_lines(f"{apiserver.url}/api/v1/pods?watch=true&resourceVersion={rv}", 1)
    assert gone[0]["type"] == "ERROR" and gone[0]["object"]["code"] == 410
    # timeoutSeconds ends the stream by itself.
    with httpx.stream("GET", f"{apiserver.url}/api/v1/nodes?watch=true&timeoutSeconds=1", timeout=5) as r:
        assert list(r.iter_lines()) == []


def test_lightkube_watch_sees_410_as_api_error(apiserver: ApiServer, kubeconfig: Path) -> None:
    c = make_client(kubeconfig)
    first = c.create(Pod.from_dict(_pod("p1")))
    c.create(Pod.from_dict(_pod("p2")))
    apiserver.compact()  # versions before now are gone; watching from the current one would still work
    with pytest.raises(ApiError) as e:
        for _ in c.watch(Pod, namespace="*", resource_version=first.metadata.resourceVersion):
            pass
    assert e.value.status.code == 410


def test_binding_decode_quirk_is_what_lightkube_does(kubeconfig: Path) -> None:
    """Why bind_pod swallows msgspec.ValidationError: the real answer is a Status, not a Binding."""
    c = make_client(kubeconfig)
    c.create(Pod.from_dict(_pod("p1")))
    from kubegpu.kube.writes import binding_object

    with pytest.raises(msgspec.ValidationError):
        c.create(binding_object("default", "p1", None, "n1"), name="p1", namespace="default")
    assert c.get(Pod, "p1", namespace="default").spec.nodeName == "n1"
