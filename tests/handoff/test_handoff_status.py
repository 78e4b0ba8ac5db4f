"""``kubegpu status`` counts what the extender counts: Kubernetes' init-container rule, acknowledged GPUs
of pods the extender did not place, collisions shown as problems, forged records refused."""

from __future__ import annotations

from kubegpu.inventory.fake import FakeBackend
from kubegpu.model import annotations as A
from kubegpu.model import signing
from kubegpu.model.allocation import ContainerAllocation, DeviceGrant, PodAllocation, encode
from kubegpu.model.records import Ack, encode_acks
from kubegpu.status.sources import pod_records
from kubegpu.status.view import build_view

KEY = b"status-test-key-0123456789abcdef"


def test_status_counts_init_containers_by_the_kubernetes_rule_and_shows_collisions() -> None:
    inv = FakeBackend("t4x4", node_name="n").discover()
    a, b = inv.gpus[0], inv.gpus[1]
    init = PodAllocation((ContainerAllocation("i", (DeviceGrant(a.minor, a.uuid, 80, 8 << 30, 80),), init=True),
                          ContainerAllocation("c", (DeviceGrant(a.minor, a.uuid, 20, 2 << 30, 20),))))
    pods = []
    for name, alloc in (("init-pod", init),
                        ("p1", PodAllocation((ContainerAllocation("c", (DeviceGrant(b.minor, b.uuid, 60, 0, 60),)),))),
                        ("p2", PodAllocation((ContainerAllocation("c", (DeviceGrant(b.minor, b.uuid, 60, 0, 60),)),)))):
        value = encode(alloc)
        pods.append({"metadata": {"name": name, "namespace": "d", "uid": name, "annotations": {
            A.DEVICE_ALLOCATED: value, signing.RECORD_SIGNATURE: signing.sign(KEY, name, "n", value)}},
            "spec": {"nodeName": "n"}, "status": {"phase": "Running"}})
    # A pod the extender did not place, acknowledged by the node on GPU 2; and a forged record on GPU 3.
    g2 = inv.gpus[2]
    ack = encode_acks({"c": Ack("nvidia.com/gpu", (g2.uuid,),
                                (DeviceGrant(g2.minor, g2.uuid, 100, g2.memory_bytes, 100),))})
    pods.append({"metadata": {"name": "plain", "namespace": "d", "uid": "plain", "annotations": {
        A.DEVICE_ASSIGNED: ack, signing.ACK_SIGNATURE: signing.sign(KEY, "plain", "n", ack, kind="ack")}},
        "spec": {"nodeName": "n"}, "status": {"phase": "Running"}})
    forged = encode(PodAllocation((ContainerAllocation("c", (DeviceGrant(3, inv.gpus[3].uuid, 100, 0, 100),)),)))
    pods.append({"metadata": {"name": "forged", "namespace": "d", "uid": "forged",
                              "annotations": {A.DEVICE_ALLOCATED: forged}},
                 "spec": {"nodeName": "n"}, "status": {"phase": "Running"}})
    problems: list[str] = []
    records = pod_records(pods, problems, KEY)
    assert sorted(r.name for r in records) == ["init-pod", "p1", "p2", "plain"]
    assert any("d/forged" in p and "not signed" in p for p in problems)
    view = build_view([inv], records)
    gpus = {g.uuid: g for g in view.nodes[0].gpus}
    assert gpus[a.uuid].core_used == 80  # max(80, 20), not 100
    assert gpus[b.uuid].core_used == 120 and any("overcommitted" in p for p in view.problems)
    assert gpus[inv.gpus[2].uuid].core_used == 100  # the default scheduler's pod is shown
    assert gpus[inv.gpus[3].uuid].core_used == 0  # the forged record counts for nothing
