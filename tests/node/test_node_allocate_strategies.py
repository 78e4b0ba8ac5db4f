"""Allocate answers under every device-list and device-ID strategy, over the real unix sockets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from kubegpu_standins.kubelet import StandinKubelet

GPU = "nvidia.com/gpu"


def _ready(kubelet: StandinKubelet, resource: str = GPU) -> None:
    assert kubelet.wait_registered(resource, timeout_s=5), kubelet.rpc_sequence()


def test_envvar_uuid_is_the_default(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("dgx1-v100")
    _ready(kubelet)
    got = kubelet.allocate(GPU, 2)
    envs = dict(got.response.envs)
    assert envs["NVIDIA_VISIBLE_DEVICES"].split(",") == list(got.device_ids)
    assert envs["KUBEGPU_VISIBLE_GPUS"] == envs["NVIDIA_VISIBLE_DEVICES"]
    assert not got.response.mounts and not got.response.devices and not got.response.cdi_devices
    assert all(u.startswith("GPU-") for u in got.device_ids)


def test_index_strategy_hands_out_nvml_indexes(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, _ = make_daemon("dgx1-v100", flags={"device-id-strategy": "index"})
    _ready(kubelet)
    got = kubelet.allocate(GPU, 2)
    index = {g.uuid: str(g.index) for g in d.inventory.gpus}
    assert got.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",") == [index[u] for u in got.device_ids]


def test_volume_mounts(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("t4x4", flags={"device-list-strategy": "volume-mounts"})
    _ready(kubelet)
    got = kubelet.allocate(GPU, 2)
    assert got.response.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert [(m.host_path, m.container_path) for m in got.response.mounts] == [
        ("/dev/null", f"/var/run/nvidia-container-devices/{u}") for u in got.device_ids]


def _toolkit(tmp_path: Path, topology: str) -> str:
    """The NVIDIA Container Toolkit (a recording stand-in) under a driver root; returns the root."""
    import fake_nvidia_ctk

    from kubegpu.inventory.topology import load_topology

    inv = load_topology(topology).inventory
    names = [(n, g.minor) for g in inv.gpus for n in (g.uuid, str(g.index))]
    fake_nvidia_ctk.install(tmp_path / "driver-root", "/usr/bin/nvidia-ctk", names)
    return str(tmp_path / "driver-root")


def test_cdi_annotations_and_spec_file(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path,
                                       tmp_path: Path) -> None:
    d, _ = make_daemon("t4x4", flags={"device-list-strategy": "cdi-annotations",
                                      "container-driver-root": _toolkit(tmp_path, "t4x4")})
    _ready(kubelet)
    got = kubelet.allocate(GPU, 1)
    (key, value), = got.response.annotations.items()
    assert key.startswith("cdi.k8s.io/kubegpu-device-plugin_") and len(key.split("/", 1)[1]) <= 63
    assert value == f"k8s.device-plugin.nvidia.com/gpu={got.device_ids[0]}"
    assert "NVIDIA_VISIBLE_DEVICES" not in got.response.envs
    spec = json.loads((sockdir / "cdi" / "k8s.device-plugin.nvidia.com-gpu.json").read_text())
    assert spec["kind"] == "k8s.device-plugin.nvidia.com/gpu" and spec["cdiVersion"]
    names = {dev["name"] for dev in spec["devices"]}
    for g in d.inventory.gpus:
        assert g.uuid in names and str(g.index) in names
    by_name = {dev["name"]: dev for dev in spec["devices"]}
    g0 = d.inventory.gpus[0]
    assert by_name[g0.uuid]["containerEdits"]["deviceNodes"] == [{"path": f"/dev/nvidia{g0.minor}",
                                                                  "hostPath": f"/dev/nvidia{g0.minor}"}]
    # The toolkit's spec: the driver's libraries and the ldcache hook, not device nodes alone.
    assert any("libcuda.so" in m["containerPath"] for m in spec["containerEdits"]["mounts"])
    assert spec["containerEdits"]["hooks"]
    # Written atomically: no temp file left behind.
    assert [p.name for p in (sockdir / "cdi").iterdir()] == ["k8s.device-plugin.nvidia.com-gpu.json"]


def test_cdi_cri_with_index_names(kubelet: StandinKubelet, make_daemon: Any, tmp_path: Path) -> None:
    d, _ = make_daemon("t4x4", flags={"device-list-strategy": "cdi-cri,envvar", "device-id-strategy": "index",
                                      "container-driver-root": _toolkit(tmp_path, "t4x4")})
    _ready(kubelet)
    got = kubelet.allocate(GPU, 2)
    index = {g.uuid: str(g.index) for g in d.inventory.gpus}
    assert [c.name for c in got.response.cdi_devices] == [
        f"k8s.device-plugin.nvidia.com/gpu={index[u]}" for u in got.device_ids]
    assert got.response.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(index[u] for u in got.device_ids)


def test_pass_device_specs(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, _ = make_daemon("t4x4", flags={"pass-device-specs": "true"})
    _ready(kubelet)
    got = kubelet.allocate(GPU, 2)
    minors = {g.uuid: g.minor for g in d.inventory.gpus}
    paths = [s.container_path for s in got.response.devices]
    assert paths == [f"/dev/nvidia{minors[u]}" for u in got.device_ids] + [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert all(s.permissions == "rw" and s.host_path == s.container_path for s in got.response.devices)


def test_mig_devices_get_their_capability_nodes(kubelet: StandinKubelet, make_daemon: Any,
                                                  sockdir: Path) -> None:
    # The driver's table of MIG capability minors (for GPU 0's instances).
    backend_gpus = __import__("kubegpu.inventory.fake", fromlist=["FakeBackend"]).FakeBackend("a100-mig")
    g0 = backend_gpus.discover().gpus[0]
    lines = []
    for k, m in enumerate(g0.mig_devices):
        lines.append(f"gpu{g0.minor}/gi{m.gi}/access {100 + 2 * k}")
        lines.append(f"gpu{g0.minor}/gi{m.gi}/ci{m.ci}/access {101 + 2 * k}")
    (sockdir / "mig-minors").write_text("\n".join(lines) + "\n")
    make_daemon("a100-mig", flags={"mig-strategy": "mixed", "pass-device-specs": "true"})
    _ready(kubelet, "nvidia.com/mig-2g.20gb")
    got = kubelet.allocate("nvidia.com/mig-2g.20gb", 1)
    k = [m.profile for m in g0.mig_devices].index("2g.20gb")
    paths = [s.container_path for s in got.response.devices]
    assert paths[:3] == [f"/dev/nvidia{g0.minor}", f"/dev/nvidia-caps/nvidia-cap{100 + 2 * k}",
                         f"/dev/nvidia-caps/nvidia-cap{101 + 2 * k}"]
    assert got.response.envs["NVIDIA_VISIBLE_DEVICES"] == got.device_ids[0]
    assert got.device_ids[0].startswith("MIG-")


def test_gds_and_mofed(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("t4x4", flags={"gds-enabled": "true", "mofed-enabled": "true"})
    _ready(kubelet)
    envs = kubelet.allocate(GPU, 1).response.envs
    assert envs["NVIDIA_GDS"] == "enabled" and envs["NVIDIA_MOFED"] == "enabled"


def test_bad_requests_fail_with_a_reason(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, backend = make_daemon("t4x4")
    _ready(kubelet)
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate_ids(GPU, ["GPU-not-here"])
    assert "invalid allocation request for 'nvidia.com/gpu': unknown device: GPU-not-here" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate_ids(GPU, [])
    assert "no device IDs" in e.value.details()
    g = d.inventory.gpus[1].uuid
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate_ids(GPU, [g, g])
    assert "duplicate" in e.value.details()
    backend.inject_xid(1, 79)
    assert kubelet.wait_for(lambda: g in kubelet.resources[GPU].unhealthy, 2)
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate_ids(GPU, [g])
    assert f"device {g} is unhealthy (Xid 79" in e.value.details()
    # The other GPUs still allocate.
    assert kubelet.allocate(GPU, 3).device_ids
    with pytest.raises(grpc.RpcError) as e:
        kubelet.preferred(GPU, ["GPU-nope"], 1)
    assert "unknown device IDs" in e.value.details()
