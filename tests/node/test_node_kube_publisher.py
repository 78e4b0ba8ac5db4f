"""The node daemon's API-server publisher: GFD labels, the Device object, and failure tolerance."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lightkube.models.meta_v1 import ObjectMeta

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube.client import make_client
from kubegpu.kube.resources import Device, Node
from kubegpu.model.device_object import inventory_from_device
from kubegpu.node.config import load_config
from kubegpu.node.publish.kube import KubeNodePublisher
from kubegpu_standins.apiserver import ApiServer


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[ApiServer, object]]:
    server = ApiServer(history=100).start()
    try:
        client = make_client(server.write_kubeconfig(tmp_path / "kubeconfig"))
        client.create(Node(metadata=ObjectMeta(name="n1", labels={
            "kubernetes.io/hostname": "n1", "nvidia.com/gpu.product": "Stale-GPU", "nvidia.com/gpu.deploy.x": "true"})))
        yield server, client
    finally:
        server.stop()


def test_publish_sets_labels_and_device_then_follows_health(api: tuple) -> None:
    _, client = api
    inv = FakeBackend("dgx-a100", node_name="n1").discover()
    pub = KubeNodePublisher(client, "n1", load_config({}, {}, None))
    pub.publish(inv, {"nvidia.com/gpu": 8})
    node = client.get(Node, "n1")
    labels = node.metadata.labels
    assert labels["nvidia.com/gpu.count"] == "8"
    assert labels["nvidia.com/gpu.product"].startswith("NVIDIA-A100")
    assert labels["nvidia.com/gpu.present"] == "true"
    assert labels["nvidia.com/gpu.deploy.x"] == "true"  # not GFD's key: left alone
    assert labels["kubernetes.io/hostname"] == "n1"
    dev = client.get(Device, "n1")
    assert dev.metadata.ownerReferences[0].uid == node.metadata.uid
    assert inventory_from_device(dev.to_dict()) == inv
    assert node.status.capacity["kubegpu.io/gpu-core"] == "800"
    assert node.status.allocatable["kubegpu.io/gpu-memory-ratio"] == "800"

    sick = inv.with_gpu_health(inv.gpus[2].uuid, False)
    pub.publish(sick, {"nvidia.com/gpu": 7})
    back = inventory_from_device(client.get(Device, "n1").to_dict())
    assert [g.healthy for g in back.gpus] == [True, True, False, True, True, True, True, True]
    assert client.get(Node, "n1").status.capacity["kubegpu.io/gpu-core"] == "700"
    assert pub.published == 2 and pub.failures == 0


def test_api_server_gone_is_logged_not_raised(api: tuple, caplog: pytest.LogCaptureFixture) -> None:
    server, client = api
    inv = FakeBackend("t4x4", node_name="n1").discover()
    pub = KubeNodePublisher(client, "n1", load_config({}, {}, None))
    server.stop()
    pub.publish(inv, {"nvidia.com/gpu": 4})
    assert pub.failures == 1 and pub.published == 0
    assert "will retry" in caplog.text


def test_missing_node_is_a_logged_failure(api: tuple) -> None:
    _, client = api
    inv = FakeBackend("t4x4", node_name="ghost").discover()
    pub = KubeNodePublisher(client, "ghost", load_config({}, {}, None))
    pub.publish(inv, {})
    assert pub.failures == 1
