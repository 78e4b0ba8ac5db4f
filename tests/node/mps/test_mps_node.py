"""Share enforcement through the node daemon: every Allocate answer on an MPS-enforced GPU, over the sockets."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from kubegpu.model.allocation import DeviceGrant
from kubegpu.model.device_object import device_object, inventory_from_device
from kubegpu.model.inventory import NodeInventory
from kubegpu.node.deviceplugin.resolver import ResolvedAllocation
from kubegpu_standins.kubelet import StandinKubelet
from kubegpu_standins.mps_control import PID_FILE, connect_client

SLOTS = "kubegpu.io/gpu.shared"
GIB = 2**30


class Records:
    """The scheduler's recorded share for whatever GPUs the kubelet picked (one pending pod at a time)."""

    def __init__(self) -> None:
        self.core, self.memory = 25, 4 * GIB

    def resolve(self, resource: str, device_ids: Sequence[str]) -> ResolvedAllocation | None:
        if resource != SLOTS:
            return None
        gpus = tuple(DeviceGrant(0, i.split("::")[0], self.core, self.memory, 0) for i in device_ids)
        return ResolvedAllocation(gpus, pod="default/p", container="c")

    def preferred(self, resource: str, available: Sequence[str], must_include: Sequence[str],
                  size: int) -> Sequence[str] | None:
        return None

    def set_inventory(self, inventory: NodeInventory) -> None:
        pass

    def kubelet_registered(self, resource: str) -> None:
        pass


def _host(resp: Any, container_path: str) -> str:
    return {m.container_path: m.host_path for m in resp.mounts}[container_path]


def _client(resp: Any, **env: str) -> dict[str, Any]:
    envs = dict(resp.envs)
    pipe = _host(resp, envs["CUDA_MPS_PIPE_DIRECTORY"])
    return connect_client({**envs, "CUDA_MPS_PIPE_DIRECTORY": pipe, **env},
                          envs["KUBEGPU_VISIBLE_GPUS"].split(","))


def _flags(sockdir: Path, mps_binary: str, **more: str) -> dict[str, str]:
    return {"shared-slots": "4", "share-enforcement": "mps", "mps-control-binary": mps_binary,
            "mps-root": str(sockdir / "mps"), **more}


def test_every_share_is_held_by_a_daemon_whose_defaults_are_the_share(
        kubelet: StandinKubelet, make_daemon: Any, sockdir: Path, mps_binary: str) -> None:
    rec = Records()
    d, _ = make_daemon("t4x4", flags=_flags(sockdir, mps_binary), resolver=rec)
    assert kubelet.wait_registered(SLOTS, timeout_s=5)
    a = kubelet.allocate(SLOTS, 1).response
    envs = dict(a.envs)
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25" and envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
    assert _host(a, "/tmp/nvidia-mps") == _host(a, envs["CUDA_MPS_PIPE_DIRECTORY"])  # unsetting the pipe dir
    raised = _client(a, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=100G")
    assert raised["thread_percentage"] == 25 and list(raised["memory_limit_mib"].values()) == [4096]
    b = kubelet.allocate(SLOTS, 1).response
    rec.core, rec.memory = 50, 8 * GIB
    c = kubelet.allocate(SLOTS, 1).response
    # Same shape on the same GPU: one server (concurrency); another shape: its own daemon.
    same_gpu = envs["KUBEGPU_VISIBLE_GPUS"] == dict(b.envs)["KUBEGPU_VISIBLE_GPUS"]
    assert (dict(b.envs)["CUDA_MPS_PIPE_DIRECTORY"] == envs["CUDA_MPS_PIPE_DIRECTORY"]) is same_gpu
    assert dict(c.envs)["CUDA_MPS_PIPE_DIRECTORY"] != envs["CUDA_MPS_PIPE_DIRECTORY"]
    assert _client(c)["thread_percentage"] == 50
    status = d.status()
    assert {e["mode"] for e in status["enforcement"].values()} == {"mps"}
    assert all(x["up"] for x in status["mps_daemons"]) and len(status["mps_daemons"]) >= 2
    inv = inventory_from_device(device_object(d.inventory and _published(d)))
    assert {g.share_enforcement for g in inv.gpus} == {"mps"}
    metrics = d.metrics.registry.get_sample_value(
        "kubegpu_node_gpu_share_enforced", {**d.metrics.device_labels(d.inventory.gpus[0].uuid), "mode": "mps"})
    assert metrics == 1


def _published(d: Any) -> Any:
    from dataclasses import replace

    table = d.enforcer.table()
    return replace(d.inventory, gpus=tuple(replace(g, share_enforcement=table[g.uuid].mode,
                                                   share_enforcement_reason=table[g.uuid].reason)
                                           for g in d.inventory.gpus))


def test_enforcement_none_serves_labels_only(kubelet: StandinKubelet, make_daemon: Any, sockdir: Path) -> None:
    make_daemon("t4x4", flags={"shared-slots": "4"}, resolver=Records())
    assert kubelet.wait_registered(SLOTS, timeout_s=5)
    envs = dict(kubelet.allocate(SLOTS, 1).response.envs)
    assert envs["KUBEGPU_GPU_CORE_PERCENT"] == "25" and not any(k.startswith("CUDA_MPS") for k in envs)


def test_a_dead_daemon_holds_its_gpu_back_until_it_answers_again(
        kubelet: StandinKubelet, make_daemon: Any, sockdir: Path, mps_binary: str) -> None:
    d, _ = make_daemon("t4x4", flags=_flags(sockdir, mps_binary), resolver=Records(), mps_supervise_s=0.1)
    assert kubelet.wait_registered(SLOTS, timeout_s=5)
    resp = kubelet.allocate(SLOTS, 1).response
    gpu = dict(resp.envs)["KUBEGPU_VISIBLE_GPUS"]
    pipe = Path(_host(resp, dict(resp.envs)["CUDA_MPS_PIPE_DIRECTORY"]))
    pid = int((pipe / PID_FILE).read_text())
    saved = d.mps.binary
    for e in d.mps._entries.values():  # the restart fails until the binary is back
        e.control.binary = str(sockdir / "gone")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and all(i.split("::")[0] != gpu for i in kubelet.unhealthy(SLOTS)):
        time.sleep(0.05)
    srv = next(s for s in d.servers if s.resource == SLOTS)
    assert "shares cannot be enforced: MPS daemon share-c25" in srv.state.reason(gpu)
    assert d.status()["enforcement"][gpu]["mode"] == "unenforced"
    with pytest.raises(grpc.RpcError, match="is unhealthy"):
        kubelet.allocate_ids(SLOTS, [dev.id for dev in srv.plan.devices if dev.uuid == gpu][:1])
    for e in d.mps._entries.values():
        e.control.binary = saved
        e.next_try = 0.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(i.split("::")[0] == gpu for i in kubelet.unhealthy(SLOTS)):
        time.sleep(0.05)
    assert srv.state.is_healthy(gpu) and _client(resp)["thread_percentage"] == 25


def test_gpus_mps_cannot_enforce_are_refused_with_the_reason(
        kubelet: StandinKubelet, make_daemon: Any, sockdir: Path, mps_binary: str) -> None:
    topo = sockdir / "pascal.yaml"
    topo.write_text("name: mixed\nnode: {cpu: 8, memory: 64Gi}\ngpus:\n"
                    "- {model: Tesla P100, memoryMiB: 16280, computeCapability: \"6.0\"}\n"
                    "- {model: Tesla V100, memoryMiB: 16160, computeCapability: \"7.0\"}\n")
    d, _ = make_daemon(str(topo), flags=_flags(sockdir, mps_binary), resolver=Records())
    assert kubelet.wait_registered(SLOTS, timeout_s=5)
    pascal, volta = d.inventory.gpus
    table = d.status()["enforcement"]
    assert table[pascal.uuid]["mode"] == "unenforced" and "older than Volta" in table[pascal.uuid]["reason"]
    assert table[volta.uuid]["mode"] == "mps"
    assert {i.split("::")[0] for i in kubelet.unhealthy(SLOTS)} == {pascal.uuid}
    assert {i.split("::")[0] for i in kubelet.healthy(SLOTS)} == {volta.uuid}
    assert kubelet.healthy("nvidia.com/gpu") == {pascal.uuid, volta.uuid}  # whole GPUs need no daemon
    srv = next(s for s in d.servers if s.resource == SLOTS)
    with pytest.raises(grpc.RpcError, match="older than Volta"):
        kubelet.allocate_ids(SLOTS, [dev.id for dev in srv.plan.devices if dev.uuid == pascal.uuid][:1])


def test_mps_replicas_on_a_pre_volta_gpu_are_a_configuration_error(make_daemon: Any, sockdir: Path,
                                                                   mps_binary: str) -> None:
    from kubegpu.node.daemon import DaemonInitError

    topo = sockdir / "pascal.yaml"
    topo.write_text("name: pascal\nnode: {cpu: 8, memory: 64Gi}\ngpus:\n"
                    "- {model: Tesla P100, memoryMiB: 16280, computeCapability: \"6.0\"}\n")
    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n")
    with pytest.raises(DaemonInitError, match="older than Volta"):
        make_daemon(str(topo), flags={"config-file": str(cfg), "mps-control-binary": mps_binary})


def test_share_enforcement_with_time_slicing_is_refused_with_the_reason(make_daemon: Any, sockdir: Path,
                                                                        mps_binary: str) -> None:
    from kubegpu.node.config import ConfigError

    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
                   "      replicas: 2\n")
    with pytest.raises(ConfigError, match="would overcommit them"):
        make_daemon("t4x4", flags=_flags(sockdir, mps_binary, **{"config-file": str(cfg)}), resolver=Records())


def test_with_an_enforcer_allocate_runs_off_the_grpc_loop(
        kubelet: StandinKubelet, make_daemon: Any, sockdir: Path, mps_binary: str) -> None:
    """Standalone, but with MPS replicas: serving them may start their MPS daemon and wait for it, which on the
    gRPC loop would hold every other call and stream of the node meanwhile."""
    import threading

    cfg = sockdir / "config.yaml"
    cfg.write_text("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 2\n")
    d, _ = make_daemon("t4x4", flags={"config-file": str(cfg), "mps-control-binary": mps_binary,
                                      "mps-root": str(sockdir / "mps")})
    server = next(s for s in d.servers if s.plan.sharing == "mps")
    assert kubelet.wait_registered(server.resource, timeout_s=5)
    threads: list[str] = []
    original = server.allocate

    def recording(request: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(request)

    server.allocate = recording  # type: ignore[method-assign]
    got = kubelet.allocate(server.resource, 1).response
    assert "CUDA_MPS_PIPE_DIRECTORY" in got.envs  # served through its MPS daemon
    assert len(threads) == 1 and threads[0].startswith("dp-"), threads
