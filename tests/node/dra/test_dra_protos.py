"""The committed DRA stubs are what the .proto files generate, and carry the kubelet's wire names."""

from __future__ import annotations

from kubegpu.node.dra.proto import dra_health_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2
from kubegpu.node.dra.proto.generate import stale_files


def test_committed_stubs_are_fresh() -> None:
    assert stale_files() == [], "run: python -m kubegpu.node.dra.proto.generate"


def test_wire_names() -> None:
    versions = ((dra_v1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1"),
                (dra_v1beta1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1beta1"))
    for pb, pkg in versions:
        svc = pb.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert pb.DESCRIPTOR.package == pkg
        assert {m.full_name for m in svc.methods} == {f"{pkg}.DRAPlugin.NodePrepareResources",
                                                     f"{pkg}.DRAPlugin.NodeUnprepareResources"}
        assert {f.name: f.number for f in pb.Device.DESCRIPTOR.fields} == {
            "request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5}
        assert {f.name: f.number for f in pb.Claim.DESCRIPTOR.fields} == {"namespace": 1, "uid": 2, "name": 3}
    reg = pluginregistration_pb2.DESCRIPTOR
    assert reg.package == "pluginregistration"
    assert [m.name for m in reg.services_by_name["Registration"].methods] == ["GetInfo", "NotifyRegistrationStatus"]
    health = dra_health_pb2.DESCRIPTOR
    watch = health.services_by_name["DRAResourceHealth"].methods_by_name["NodeWatchResources"]
    assert watch.full_name == "v1alpha1.DRAResourceHealth.NodeWatchResources" and watch.server_streaming
    assert {f.name: f.number for f in dra_health_pb2.DeviceHealth.DESCRIPTOR.fields} == {
        "device": 1, "health": 2, "last_updated_time": 3, "health_check_timeout_seconds": 4, "message": 5}
