"""What a container gets is one value (``ContainerEdits``): the device plugin's Allocate response and DRA's CDI spec
render the same edits for the same grants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubegpu.model.allocation import DeviceGrant
from kubegpu.node.container_edits import CONTROL_DEVICES, container_edits, one_or_list
from kubegpu.node.deviceplugin.allocate import build_response, container_edits_for
from kubegpu.node.deviceplugin.plugin_model import AdvertisedDevice, PluginSettings, ResourcePlan
from kubegpu.node.deviceplugin.resolver import ResolvedAllocation
from kubegpu.node.dra.names import TYPE_GPU, TYPE_MIG
from kubegpu.node.dra.prepare import PrepareError, Preparer
from kubegpu.node.dra.slices import DraSettings, PublishedDevice

GIB = 2**30
SLOTS = "kubegpu.io/gpu.shared"


class NoClaims:
    def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        raise PrepareError("not read in these tests")


def _dra_env_and_nodes(tmp_path: Path, used: list[tuple[PublishedDevice, dict[str, Any]]]) -> tuple[
        dict[str, str], list[str]]:
    preparer = Preparer(NoClaims(), dict, DraSettings(node_name="n", mig_minors_file=str(tmp_path / "minors")),
                        cdi_dir=tmp_path / "cdi", state_dir=tmp_path / "state")
    spec = preparer._spec("ns", "claim", "uid", used)
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    nodes = [n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    return env, nodes + [n["path"] for n in spec["containerEdits"]["deviceNodes"]]


def _dp_response(plan: ResourcePlan, resolved: ResolvedAllocation | None, ids: list[str]) -> Any:
    known = {d.id: d for d in plan.devices}
    by_uuid = {d.uuid: d for d in plan.devices}
    settings = PluginSettings(pass_device_specs=True)
    edits = container_edits_for(plan, ids, known, settings, resolved=resolved, by_uuid=by_uuid)
    return build_response(plan, edits, settings)


def test_a_share_gets_the_same_edits_from_the_device_plugin_and_from_dra(tmp_path: Path) -> None:
    gpus = [(i, f"GPU-{i}") for i in (3, 5)]
    plan = ResourcePlan(SLOTS, tuple(AdvertisedDevice(f"{u}::0", u, str(i), u, i, memory_bytes=16 * GIB)
                                     for i, u in gpus), sharing="slots", replicas=4)
    resolved = ResolvedAllocation(tuple(DeviceGrant(i, u, 25, 4 * GIB, 25) for i, u in gpus), pod="ns/p")
    resp = _dp_response(plan, resolved, [f"{u}::0" for _, u in gpus])

    published = [PublishedDevice(f"gpu-{i}", "n", TYPE_GPU, u, u, i, i, 16 * GIB, share_memory_max=16 * GIB)
                 for i, u in gpus]
    used = [(d, {"device": d.name, "pool": "n", "request": "r", "shareID": f"s{d.index}",
                 "consumedCapacity": {"compute": "25", "memory": "4Gi"}}) for d in published]
    env, nodes = _dra_env_and_nodes(tmp_path, used)

    shared = ("NVIDIA_VISIBLE_DEVICES", "KUBEGPU_VISIBLE_GPUS", "KUBEGPU_GPU_CORE_PERCENT",
              "KUBEGPU_GPU_MEMORY_BYTES")
    assert {k: resp.envs[k] for k in shared} == {k: env[k] for k in shared} == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-3,GPU-5", "KUBEGPU_VISIBLE_GPUS": "GPU-3,GPU-5",
        "KUBEGPU_GPU_CORE_PERCENT": "25", "KUBEGPU_GPU_MEMORY_BYTES": str(4 * GIB)}
    assert env["KUBEGPU_SHARE_IDS"] == "s3,s5"
    assert [d.container_path for d in resp.devices] == nodes == ["/dev/nvidia3", "/dev/nvidia5", *CONTROL_DEVICES]


def test_whole_gpus_carry_no_share_limits_on_either_path(tmp_path: Path) -> None:
    plan = ResourcePlan("nvidia.com/gpu", (AdvertisedDevice("GPU-0", "GPU-0", "0", "GPU-0", 0, memory_bytes=GIB),))
    resp = _dp_response(plan, None, ["GPU-0"])
    dev = PublishedDevice("gpu-0", "n", TYPE_GPU, "GPU-0", "GPU-0", 0, 0, GIB)
    env, _ = _dra_env_and_nodes(tmp_path, [(dev, {"device": "gpu-0", "pool": "n", "request": "r"})])
    for got in (dict(resp.envs), env):
        assert got["KUBEGPU_VISIBLE_GPUS"] == "GPU-0" and "KUBEGPU_GPU_CORE_PERCENT" not in got


def test_a_mig_device_gets_its_capability_nodes() -> None:
    mig = PublishedDevice("gpu-0-mig", "n", TYPE_MIG, "MIG-a", "GPU-0", 0, 2, GIB, gi=1, ci=0)
    edits = container_edits([("MIG-a", mig)], ["GPU-0"], minors={(2, 1, -1): 21, (2, 1, 0): 22})
    assert edits.devices[0].nodes == ("/dev/nvidia2", "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22")
    assert edits.device_nodes()[-len(CONTROL_DEVICES):] == list(CONTROL_DEVICES)


def test_share_values_are_one_value_or_one_per_gpu() -> None:
    assert one_or_list([25, 25]) == "25"
    assert one_or_list([25, 50]) == "25,50"
