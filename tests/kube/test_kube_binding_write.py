"""The extender's Binding write (:func:`kubegpu.kube.writes.abind_pod`) sends what lightkube's
``client.create(Pod.Binding)`` sends, with lightkube's own HTTP settings over its kept connections
(:mod:`kubegpu.kube.kept_http`), and fails as it does."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import httpx2
import msgspec
import pytest
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.core_v1 import ObjectReference
from lightkube.models.meta_v1 import ObjectMeta

from kubegpu.kube.client import lightkube_http, make_async_client
from kubegpu.kube.kept_http import binding_client
from kubegpu.kube.resources import Pod
from kubegpu.kube.writes import abind_pod
from kubegpu_standins.apiserver import ApiServer


def _pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns"},
            "spec": {"containers": [{"name": "main", "image": "x"}]}}


def _capture(client: AsyncClient) -> list[httpx2.Request]:
    """What lightkube's own HTTP client and the Bindings' send, in order."""
    sent: list[httpx2.Request] = []

    async def hook(request: httpx2.Request) -> None:
        sent.append(request)

    for http in (lightkube_http(client)[0], binding_client(client)):
        http.event_hooks["request"].append(hook)
    return sent


def test_the_binding_is_the_request_lightkube_makes(apiserver: ApiServer, kubeconfig: Path) -> None:
    async def go() -> tuple[list[httpx2.Request], dict[str, Any], dict[str, Any]]:
        client = make_async_client(kubeconfig)
        try:
            a = apiserver.put_object(_pod("a"))
            b = apiserver.put_object(_pod("b"))
            sent = _capture(client)
            record = {"kubegpu.io/device-allocated": "v1;x"}
            # lightkube's own model cannot decode the Status the API server answers (why SlimBinding exists):
            # the request it sent is what counts here.
            with contextlib.suppress(msgspec.ValidationError):
                await client.create(Pod.Binding(
                    metadata=ObjectMeta(name="a", namespace="ns", uid=a["metadata"]["uid"],
                                        resourceVersion=a["metadata"]["resourceVersion"], annotations=record),
                    target=ObjectReference(apiVersion="v1", kind="Node", name="node-1")), name="a", namespace="ns")
            await abind_pod(client, "ns", "b", b["metadata"]["uid"], "node-1", record,
                            resource_version=b["metadata"]["resourceVersion"])
            return sent, apiserver.get_object("pods", "a", "ns"), apiserver.get_object("pods", "b", "ns")
        finally:
            await client.close()

    sent, pod_a, pod_b = asyncio.run(go())
    ours_ref, ours = sent
    assert ours.method == ours_ref.method == "POST"
    assert str(ours.url) == str(ours_ref.url).replace("/pods/a/", "/pods/b/")
    assert ours.url.params["fieldManager"] == "kubegpu"
    assert ours.headers["content-type"] == ours_ref.headers["content-type"] == "application/json"
    assert ours.headers["user-agent"] == ours_ref.headers["user-agent"]
    body, ref = json.loads(ours.content), json.loads(ours_ref.content)
    for d in (body, ref):
        d["metadata"].pop("name"), d["metadata"].pop("uid"), d["metadata"].pop("resourceVersion")
    assert body == ref
    for pod in (pod_a, pod_b):
        assert pod["spec"]["nodeName"] == "node-1"
        assert pod["metadata"]["annotations"]["kubegpu.io/device-allocated"] == "v1;x"


@pytest.mark.parametrize("case, code", [("stale", 409), ("recreated", 409), ("bound", 409), ("gone", 404)])
def test_a_refused_binding_raises_lightkubes_error(apiserver: ApiServer, kubeconfig: Path, case: str,
                                                   code: int) -> None:
    async def go() -> ApiError:
        client = make_async_client(kubeconfig)
        try:
            pod = apiserver.put_object(_pod("p"))
            uid, version = pod["metadata"]["uid"], pod["metadata"]["resourceVersion"]
            if case == "stale":  # the pod changed since this version was read
                version = str(int(version) - 1)
            elif case == "recreated":
                uid = "another-uid"
            elif case == "bound":  # by an earlier write
                await abind_pod(client, "ns", "p", uid, "node-0", resource_version=version)
                version = apiserver.get_object("pods", "p", "ns")["metadata"]["resourceVersion"]
            with pytest.raises(ApiError) as caught:
                await abind_pod(client, "ns", "q" if case == "gone" else "p", uid, "node-1",
                                resource_version=version)
            return caught.value
        finally:
            await client.close()

    assert asyncio.run(go()).status.code == code
