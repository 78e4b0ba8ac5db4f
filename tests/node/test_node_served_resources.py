"""The names a node serves reach readers of Nodes: the publisher annotates the Node, ``kubegpu status`` counts
renamed replica pods (the seed's nvidia.com/small) without being told the names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from lightkube.models.meta_v1 import ObjectMeta

from kubegpu.inventory.fake import FakeBackend
from kubegpu.kube.client import make_client
from kubegpu.kube.resources import Node
from kubegpu.model.resources import SERVED_RESOURCES_ANNOTATION, served_resources
from kubegpu.node.config import load_config
from kubegpu.node.deviceplugin.resources import expand, resource_counts
from kubegpu.node.publish.kube import KubeNodePublisher
from kubegpu.status.sources import from_api_server
from kubegpu_standins.apiserver import ApiServer


@pytest.fixture
def api(tmp_path: Path) -> Iterator[object]:
    server = ApiServer(history=100).start()
    try:
        client = make_client(server.write_kubeconfig(tmp_path / "kubeconfig"))
        client.create(Node(metadata=ObjectMeta(name="n1", annotations={"other": "kept"})))
        yield client
    finally:
        server.stop()


def test_the_node_says_what_it_serves_and_status_counts_renamed_replicas(api: object) -> None:
    client = api
    config = load_config(flags={"resource-config": "gpu:small:2", "shared-slots": 0})
    inv = FakeBackend("t4x4", node_name="n1").discover()
    counts = resource_counts(list(expand(inv, config=config)))
    assert "nvidia.com/small" in counts
    KubeNodePublisher(client, "n1", config).publish(inv, counts)
    node = client.get(Node, "n1").to_dict()
    assert node["metadata"]["annotations"]["other"] == "kept"
    assert served_resources([node]) == frozenset(counts)
    assert node["metadata"]["annotations"][SERVED_RESOURCES_ANNOTATION] == ",".join(sorted(counts))

    from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements

    from kubegpu.kube.resources import Pod

    client.create(Pod(metadata=ObjectMeta(name="p", namespace="default"),
                      spec=PodSpec(nodeName="n1", containers=[Container(
                          name="c", image="cuda", resources=ResourceRequirements(limits={"nvidia.com/small": "1"}))])))
    snap = from_api_server(client, {})
    assert [(r.name, r.resource, r.count) for r in snap.replica_pods] == [("p", "nvidia.com/small", 1)]
