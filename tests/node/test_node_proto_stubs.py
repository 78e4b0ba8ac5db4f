"""The committed gRPC stubs are what the .proto files generate, and speak the kubelet's wire names."""

from __future__ import annotations

from pathlib import Path

from kubegpu.node.proto import deviceplugin_pb2 as dp
from kubegpu.node.proto import podresources_pb2 as pr
from kubegpu.node.proto.generate import stale_files

# Recorded from a real kubelet v1.24, shipped with the tests.
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubelet-v1.24"


def test_committed_stubs_are_fresh() -> None:
    assert stale_files() == [], "run: python -m kubegpu.node.proto.generate"


def test_wire_names_and_field_numbers() -> None:
    svc = dp.DESCRIPTOR.services_by_name
    assert dp.DESCRIPTOR.package == "v1beta1"
    assert {m.full_name for m in svc["DevicePlugin"].methods} == {
        "v1beta1.DevicePlugin.GetDevicePluginOptions", "v1beta1.DevicePlugin.ListAndWatch",
        "v1beta1.DevicePlugin.GetPreferredAllocation", "v1beta1.DevicePlugin.Allocate",
        "v1beta1.DevicePlugin.PreStartContainer"}
    assert [m.name for m in svc["Registration"].methods] == ["Register"]
    law = svc["DevicePlugin"].methods_by_name["ListAndWatch"]
    assert law.server_streaming and not law.client_streaming
    fields = {f.name: f.number for f in dp.ContainerAllocateResponse.DESCRIPTOR.fields}
    assert fields == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
    assert {f.name: f.number for f in dp.ContainerPreferredAllocationRequest.DESCRIPTOR.fields} == {
        "available_deviceIDs": 1, "must_include_deviceIDs": 2, "allocation_size": 3}
    assert {f.name: f.number for f in dp.RegisterRequest.DESCRIPTOR.fields} == {
        "version": 1, "endpoint": 2, "resource_name": 3, "options": 4}
    assert pr.DESCRIPTOR.package == "v1"
    lister = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert [m.name for m in lister.methods] == ["List", "GetAllocatableResources", "Get"]
    assert {f.name: f.number for f in pr.ContainerDevices.DESCRIPTOR.fields} == {
        "resource_name": 1, "device_ids": 2, "topology": 3}


def test_a_recorded_allocate_response_decodes() -> None:
    """The fixture checkpoint's AllocResp (protobuf from a real v1.24 kubelet) decodes with our stubs."""
    import base64
    import json

    path = FIXTURES / "checkpoint-before-kubelet-restart.json"
    data = json.loads(path.read_text())
    entry = data["Data"]["PodDeviceEntries"][0]
    resp = dp.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
    ids = [i for ids in entry["DeviceIDs"].values() for i in ids]
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(ids)
