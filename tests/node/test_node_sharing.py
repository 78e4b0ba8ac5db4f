"""MIG strategies and NVIDIA's replica options, served over the real sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from kubegpu.node.daemon import DaemonInitError
from kubegpu.node.deviceplugin.allocate import AllocateError
from kubegpu_standins.kubelet import StandinKubelet
from kubegpu_standins.mps_control import connect_client


def test_mig_mixed_serves_one_resource_per_profile(kubelet: StandinKubelet, make_daemon: Any) -> None:
    d, _ = make_daemon("a100-mig", flags={"mig-strategy": "mixed"})
    assert kubelet.wait_registered("nvidia.com/mig-1g.10gb", timeout_s=5)
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    assert kubelet.capacity("nvidia.com/gpu") == 2  # the two whole GPUs
    assert kubelet.capacity("nvidia.com/mig-1g.10gb") == 2
    assert kubelet.capacity("nvidia.com/mig-3g.40gb") == 2
    names = {p.name for p in (s.plan for s in d.servers)}
    assert names == {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb",
                     "nvidia.com/mig-3g.40gb", "nvidia.com/mig-4g.40gb"}
    got = kubelet.allocate("nvidia.com/mig-3g.40gb", 2)
    assert got.response.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(got.device_ids)


def test_mig_none_ignores_mig(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("a100-mig", flags={"mig-strategy": "none"})
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    assert kubelet.capacity("nvidia.com/gpu") == 4
    assert [r for r in kubelet.resources if r.startswith("nvidia.com/mig-")] == []


def test_mig_single_refuses_a_mixed_node(make_daemon: Any) -> None:
    with pytest.raises(DaemonInitError, match="invalid MIG configuration"):
        make_daemon("a100-mig", flags={"mig-strategy": "single"})


def test_mig_single_refusal_blocks_without_fail_on_init_error(kubelet: StandinKubelet,
                                                              make_daemon: Any) -> None:
    d, _ = make_daemon("a100-mig", flags={"mig-strategy": "single", "fail-on-init-error": "false"})
    assert d.waiting_reason and not d.servers
    assert kubelet.register_count() == 0


def test_fail_requests_greater_than_one(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path) -> None:
    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
                   "    failRequestsGreaterThanOne: true\n    resources:\n"
                   "    - name: nvidia.com/gpu\n      replicas: 3\n")
    make_daemon("t4x4", flags={"config-file": str(cfg)})
    res = "nvidia.com/gpu.shared"
    assert kubelet.wait_registered(res, timeout_s=5)
    assert kubelet.capacity(res) == 12 and "nvidia.com/gpu" not in kubelet.resources
    with pytest.raises(Exception) as e:
        kubelet.allocate(res, 2)
    assert "request for 'nvidia.com/gpu.shared: 2' too large: maximum request size for shared resources is 1" \
        in str(e.value)
    ok = kubelet.allocate(res, 1)
    assert ok.device_ids[0].endswith(("::0", "::1", "::2"))


def test_devices_selection_keeps_the_rest_whole(kubelet: StandinKubelet, make_daemon: Any,
                                                sockdir: Path) -> None:
    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                   "    - name: nvidia.com/gpu\n      rename: nvidia.com/gpu-ts\n      replicas: 2\n"
                   "      devices: [0, 2]\n")
    d, _ = make_daemon("t4x4", flags={"config-file": str(cfg)})
    assert kubelet.wait_registered("nvidia.com/gpu-ts", timeout_s=5)
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    shared = kubelet.healthy("nvidia.com/gpu-ts")
    idx = {g.uuid: g.index for g in d.inventory.gpus}
    assert {idx[i.split("::")[0]] for i in shared} == {0, 2} and len(shared) == 4
    assert {idx[i] for i in kubelet.healthy("nvidia.com/gpu")} == {1, 3}


def test_mps_replicas_are_served_through_their_daemon(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path,
                                                      mps_binary: str) -> None:
    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n")
    root = sockdir / "mps"
    d, _ = make_daemon("l4x8", flags={"config-file": str(cfg), "mps-control-binary": mps_binary,
                                      "mps-root": str(root)})
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    got = kubelet.allocate("nvidia.com/gpu", 1)
    envs = got.response.envs
    uuid = got.device_ids[0].split("::")[0]
    mib = d.inventory.gpu(uuid).memory_bytes // 4 // 2**20
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={mib}M"
    assert envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com_gpu/pipe"
    mounts = {m.container_path: m.host_path for m in got.response.mounts}
    assert mounts[envs["CUDA_MPS_PIPE_DIRECTORY"]] == mounts["/tmp/nvidia-mps"] == str(root / "nvidia.com_gpu/pipe")
    assert mounts["/dev/shm"] == str(root / "shm")
    # A client that raises its own limits through that pipe gets the daemon's defaults (the H200's ceilings).
    client = connect_client({"CUDA_MPS_PIPE_DIRECTORY": mounts[envs["CUDA_MPS_PIPE_DIRECTORY"]],
                             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
                             "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=140G"}, [uuid])
    assert client["mps"] and client["thread_percentage"] == 25 and client["memory_limit_mib"][uuid] == mib


def test_mps_replicas_without_a_daemon_are_unhealthy_and_refused(kubelet: StandinKubelet, make_daemon: Any,
                                                                 sockdir: Path) -> None:
    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n")
    d, _ = make_daemon("l4x8", flags={"config-file": str(cfg), "mps-control-binary": str(sockdir / "missing"),
                                      "nvidia-driver-root": str(sockdir), "mps-root": str(sockdir / "mps")})
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    assert not kubelet.healthy("nvidia.com/gpu") and kubelet.capacity("nvidia.com/gpu") == 32
    (srv,) = d.servers
    dev = srv.plan.devices[0]
    assert "nvidia-cuda-mps-control not found" in srv.state.reason(dev.uuid)
    with pytest.raises(AllocateError, match="nvidia-cuda-mps-control not found"):
        srv.allocate_one([dev.id])


def test_mps_on_mig_is_refused(make_daemon: Any, sockdir: Path) -> None:
    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/mig-1g.10gb\n"
                   "      replicas: 2\n")
    with pytest.raises(DaemonInitError, match="MPS is not supported for MIG"):
        make_daemon("a100-mig", flags={"config-file": str(cfg), "mig-strategy": "mixed"})


def test_unknown_flag_is_a_config_error(make_daemon: Any) -> None:
    from kubegpu.node.config import ConfigError

    with pytest.raises(ConfigError, match="--no-such-flag"):
        make_daemon("t4x4", flags={"no-such-flag": "1"})


def test_grpc_error_type_for_refusals(kubelet: StandinKubelet, make_daemon: Any) -> None:
    make_daemon("t4x4")
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    with pytest.raises(grpc.RpcError) as e:
        kubelet.allocate_ids("nvidia.com/gpu", ["x"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_mig_single_serves_mig_devices_as_gpus(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path) -> None:
    topo = sockdir / "a100-single.yaml"
    mig = ", ".join(f"{{profile: 1g.10gb, gi: {gi}, ci: 0}}" for gi in (7, 8, 9, 10, 11, 12, 13))
    topo.write_text("name: a100-single\ngpu: {model: NVIDIA A100-SXM4-80GB, memoryMiB: 81920, "
                    "computeCapability: '8.0', migCapable: true}\n"
                    f"gpus:\n  - {{numa: 0, mig: [{mig}]}}\n  - {{numa: 1, mig: [{mig}]}}\n")
    make_daemon(str(topo), flags={"mig-strategy": "single"})
    assert kubelet.wait_registered("nvidia.com/gpu", timeout_s=5)
    assert kubelet.capacity("nvidia.com/gpu") == 14
    assert all(i.startswith("MIG-") for i in kubelet.healthy("nvidia.com/gpu"))
    got = kubelet.allocate("nvidia.com/gpu", 2)
    assert got.response.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(got.device_ids)
